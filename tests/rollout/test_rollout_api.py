"""The rollout contract (`miles_k3.rollout.api`): the version rule, the memory tags, the records, that both
engines (native on k3_tiny, SGLang over the recorded-interface double) satisfy the `Engine` protocol, and that what
an engine can do is declared (`EngineCapabilities`) and asked, by the config checks as by the engines' callers."""
import dataclasses

import pytest
import torch
from engine_helpers import small_engine

from miles_k3.config import ConfigFieldError, compose_config
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.rollout.api import (
    BACKEND_CAPABILITIES,
    NATIVE_MEMORY_TAGS,
    SGLANG_MEMORY_TAGS,
    Engine,
    EngineCapabilities,
    VersionedEngine,
    capabilities,
    check_forward,
    check_tags,
    error_record,
    sample_meta,
)
from miles_k3.rollout.engine import EngineConfig
from tests.sglang_helpers import double_engine


def test_versions_only_move_forward_with_old_and_new_named():
    engine = VersionedEngine()
    assert engine.weight_version == 0 and engine.next_version(None) == 1 and engine.next_version(5) == 5
    engine.weight_version = 4
    engine.weight_version = 4  # stating the served version again is allowed
    with pytest.raises(ValueError, match=r"^weight_version: versions only move forward; the engine serves version "
                                         r"4, the new version is 3$"):
        engine.weight_version = 3
    with pytest.raises(ValueError, match=r"serves version 4, the push has 4$"):
        engine.next_version(4)  # a push must be newer
    with pytest.raises(TypeError, match=r"must be an int, got .5."):
        engine.weight_version = "5"
    assert engine.weight_version == 4
    check_forward(4, 5, strict=True)


def test_memory_tags_default_to_all_and_unknown_ones_name_the_backend():
    assert check_tags(None, NATIVE_MEMORY_TAGS, "native") == ["kv_cache", "cuda_graph"]
    assert check_tags(None, SGLANG_MEMORY_TAGS, "sglang") == ["kv_cache", "weights", "cuda_graph"]
    assert check_tags(["cuda_graph"], NATIVE_MEMORY_TAGS, "native") == ["cuda_graph"]
    with pytest.raises(ValueError, match=r"memory tags \['weights'\] are not supported by the native engine; it "
                                         r"has \['kv_cache', 'cuda_graph'\]"):
        check_tags(["kv_cache", "weights"], NATIVE_MEMORY_TAGS, "native")


def test_records_carry_sglangs_keys():
    assert error_record("too long") == {"error": "too long", "meta_info": {"finish_reason": {
        "type": "abort", "message": "too long"}}}
    meta = sample_meta({"type": "length", "matched": None}, 3, 2, 1, {7, 5})
    assert meta == {"finish_reason": {"type": "length", "matched": None}, "prompt_tokens": 3,
                    "completion_tokens": 2, "cached_tokens": 1, "weight_version": 7, "weight_versions": [5, 7]}
    with pytest.raises(ValueError, match="at least one weight version"):
        sample_meta({"type": "length"}, 1, 1, 0, set())


@pytest.fixture(scope="module")
def native():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny")).eval().requires_grad_(False)
    return small_engine(model, prefill_chunk=EngineConfig.prefill_chunk)


def test_both_engines_satisfy_the_protocol(native):
    sglang = double_engine()
    for engine, backend, needs in ((native, "native", False), (sglang, "sglang", True)):
        assert isinstance(engine, Engine)
        assert engine.backend == backend and engine.push_needs_memory is needs
    with pytest.raises(ValueError, match="the sglang engine does not record routed experts"):
        sglang.generate(input_ids=[[1]], return_routed_experts=True)
    assert sglang.engine.calls_of("generate") == []  # refused before anything was sent
    with pytest.raises(ValueError, match="lora_name is required; the native engine shares the trainer's base"):
        native.update_weights_from_tensor({})
    native.close()  # nothing to end; the engine still serves
    assert native.generate(input_ids=[[1, 2]], sampling_params={"max_new_tokens": 1})[0]["meta_info"][
        "completion_tokens"] == 1


def test_engines_setters_refuse_an_older_version(native):
    sglang = double_engine()
    sglang.weight_version = 3
    with pytest.raises(ValueError, match="engine serves version 3, the new version is 2"):
        sglang.weight_version = 2
    native.weight_version = 2
    with pytest.raises(ValueError, match="engine serves version 2, the new version is 1"):
        native.weight_version = 1


def test_each_backend_declares_what_it_can_do_and_the_config_asks_that_not_its_name(native, monkeypatch):
    """The table, by hand: the native engine runs over this process's model, keeps a conversation's state, queues
    partial rollouts, records routes, reports unfiltered log-probs and times its phases; SGLang's offline Engine
    does none of these and can also release its weights. Each engine carries its backend's entry. A backend that
    keeps no state (here: the native engine's entry without `keeps_state`, under a name of its own) is refused a
    multi-turn env.keep_state run by that capability alone, and one with the native engine's entry under another
    name is not."""
    nat, sgl = capabilities("native"), capabilities("sglang")
    assert (nat.in_process_model, nat.keeps_state, nat.partial_queue, nat.records_routes, nat.unfiltered_logprobs,
            nat.timing, nat.memory_tags) == (True, True, True, True, True, True, ("kv_cache", "cuda_graph"))
    assert (sgl.in_process_model, sgl.keeps_state, sgl.partial_queue, sgl.records_routes, sgl.unfiltered_logprobs,
            sgl.timing, sgl.memory_tags) == (False, False, False, False, False, False,
                                             ("kv_cache", "weights", "cuda_graph"))
    assert native.capabilities is nat and double_engine().capabilities is sgl
    assert not any(dataclasses.astuple(EngineCapabilities()))  # the default: an engine that only generates
    with pytest.raises(ValueError, match=r"^backend: 'vllm' is not one of native, sglang$"):
        capabilities("vllm")

    multi_turn = ["env=guess", "env.max_turns=3"]
    assert compose_config("train", multi_turn).env.keep_state  # the native engine: allowed
    monkeypatch.setitem(BACKEND_CAPABILITIES, "forgetful", dataclasses.replace(nat, keeps_state=False))
    with pytest.raises(ConfigFieldError, match=r"^env.keep_state: keeping an episode's state in the engine between "
                                               r"turns needs engine.backend=native \(the forgetful engine keeps no "
                                               r"state between requests\); set env.keep_state=false$"):
        compose_config("train", [*multi_turn, "engine.backend=forgetful"])
    cfg = compose_config("train", [*multi_turn, "engine.backend=forgetful", "env.keep_state=false"])
    assert cfg.engine.backend == "forgetful"  # the rest of the forgetful engine's run is the native one's
    monkeypatch.setitem(BACKEND_CAPABILITIES, "rememberer", nat)  # another name, the native engine's capabilities
    assert compose_config("train", [*multi_turn, "engine.backend=rememberer"]).env.keep_state
