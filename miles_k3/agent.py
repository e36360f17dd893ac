"""`env=agent env.agent=MODULE:FUNCTION`: rollouts played by agent code written against the OpenAI client.

The trainer serves its own engine over the OpenAI-compatible API of `miles_k3.serve`, in-process, on a loopback port
(127.0.0.1, a free port, for the run). Every episode gets its own base URL, `http://127.0.0.1:PORT/episodes/ID/v1`
(ID: 128 random bits, the episode's credential, valid while it runs; the key an agent passes to its client is
ignored), and the agent function is called once per episode, in a thread:

    def my_agent(problem: str, base_url: str) -> str | float:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": problem}])
        ...                                   # more turns: the messages so far, the replies as returned, new ones
        return final_answer                   # graded by reward.name against the problem's answer (or a float reward)

So an agent already written against the OpenAI client trains by changing its base_url. All the chat requests of an
episode are one session of the server (`serve.py`): its messages must extend the previous request's (the replies as
returned), and the server keeps the exact tokens the engine saw (sampled ids as sampled, each new message's ids
appended), their log-probs (under top-p / top-k also the unfiltered ones, as the engine reports them: the sample's
`unfiltered_logprobs`, which the loss takes) and weight versions, and the loss mask. The trainer's rollout settings
replace the
request's sampling fields (temperature, top_p, top_k, max_tokens = rollout.max_new_tokens; turn k of episode e
samples with the seed the trainer derives for e, + k), so the samples are what the loss expects. At most
env.max_turns requests per episode; an episode that runs past env.step_timeout_s x env.max_turns, raises, or never
calls the server is left out of the loss (env/timeout_rate, env/error_rate). Concurrent episodes' requests share
engine calls (the server batches what arrives while the engine is busy). Every other endpoint of the in-process
server (/v1/...) requires the run's random key, which only the trainer holds, so nothing else on the machine makes
sessions on the training engine; an episode's session is deleted when the episode ends (when its running turn ends,
for an episode that ran over).

The loop's held-out eval (eval.every_n_steps) plays its problems with the same agent code at the eval's sampling
settings (trainer/episode_eval.py). Not with: data / tensor / expert parallelism (the agents' engine calls are not in
lockstep across ranks), rollout.mode=partial, routing replay (the server does not record routes),
engine.backend=sglang: refused at validation. Needs the serve extra (FastAPI, uvicorn) and `openai` for the agents.
"""
from __future__ import annotations

import concurrent.futures as cf
import importlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable

from miles_k3.config import ServeConfig
from miles_k3.envs.env import EnvConfig
from miles_k3.evals.problems import Problem
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.episodes import Episode
from miles_k3.trainer.rollouts import PromptStream, RolloutConfig, SyncRollouts
from miles_k3.trainer.seeds import sampling_params, turn_seed
from miles_k3.trainer.sources import EpisodePlayer

log = logging.getLogger("miles_k3.train")

AgentFn = Callable[[str, str], "str | float"]


def load_agent(spec: str) -> AgentFn:
    """`MODULE:FUNCTION` (the user's configuration, imported like a plugin); ValueError naming what is missing."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise ValueError(f"env.agent: give MODULE:FUNCTION (e.g. my_agents:solve), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"env.agent: cannot import module {module_name!r}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"env.agent: module {module_name!r} has no function {fn_name!r}")  # noqa: TRY004
    return fn


class AgentRollouts(EpisodePlayer):
    """env=agent's rollouts. The `EpisodePlayer` that plays a round with the agent function (`play`), for the
    held-out eval (`trainer.episode_eval`) and for `collect_rollouts`, in place of the environment's turn loop; and,
    given the prompt stream, the reward and the rollout config, the run's `RolloutSource` (`collect`, `state`,
    `load_state`): rollout.mode=sync's producer (`rollouts.SyncRollouts`) with its episodes played here, every sample
    drawn with the trainer's adapter. The server starts on the first round and stops with `close`."""

    def __init__(self, fn: AgentFn, engine, tokenizer, env_cfg: EnvConfig, lora: str | None,
                 stream: PromptStream | None = None, reward_fn=None, cfg: RolloutConfig | None = None):
        self.fn, self.engine, self.tokenizer, self.env_cfg, self.lora = fn, engine, tokenizer, env_cfg, lora
        self._server = self._uvicorn = self._thread = None
        self.port = 0
        self.api_key = secrets.token_urlsafe(32)  # the run's key to the server's /v1 endpoints (agents need none)
        self._steps = None if stream is None else SyncRollouts(engine, tokenizer, stream, reward_fn, cfg, lora,
                                                                env=(self, env_cfg))

    # ---- the run's rollouts (`sources.RolloutSource`) --------------------------------------------------------
    def collect(self, version: int) -> tuple[list[Sample], dict[str, float]]:
        """The step's samples and metrics (`SyncRollouts.collect`: every sample on-policy for `version`)."""
        return self._source().collect(version)

    def state(self) -> dict:
        return self._source().state()

    def load_state(self, state: dict) -> None:
        self._source().load_state(state)

    def _source(self) -> SyncRollouts:
        if self._steps is None:
            raise RuntimeError("AgentRollouts: built without a prompt stream, reward and rollout config, it plays "
                               "episodes (play) but produces no steps")
        return self._steps

    # ---- the server ----------------------------------------------------------------------------------------
    def _start(self) -> None:
        try:
            import uvicorn

            from miles_k3.rollout.server import build_app
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(f"env=agent serves the engine over HTTP: pip install -e '.[serve]' ({e})") \
                from None
        # Episodes' sessions are one per open episode, ended with it; max_sessions bounds the key holders' others.
        app = build_app(self.engine, self.tokenizer, ServeConfig(), self.lora, api_key=self.api_key)
        self._server = app.state.server
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._uvicorn = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="agent-server")
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("env=agent: the in-process OpenAI-compatible server did not start")
            time.sleep(0.01)
        log.info("env=agent: serving the policy at http://127.0.0.1:%d/episodes/<id>/v1", self.port)

    def close(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=10)
            self._uvicorn = None

    # ---- a round -------------------------------------------------------------------------------------------
    def play(self, drawn: list[tuple[int, Problem]], seeds: list[int], cfg) -> list[Episode]:
        """group_size episodes of each drawn problem (the agent gets the problem's text and its episode's base URL;
        sampling seeds from `seeds`), in order (problem i's episode j at i * group_size + j), each an `Episode`
        holding the session's tokens as one record, `answer` the agent's returned text (or `reward` its float)."""
        if self._uvicorn is None:
            self._start()
        g, ec = cfg.group_size, self.env_cfg
        sp = sampling_params(cfg, None)  # the server's names for the rollout's sampling settings
        params = {"temperature": sp["temperature"], "top_p": sp["top_p"], "top_k": sp["top_k"],
                  "max_tokens": sp["max_new_tokens"], "max_turns": ec.max_turns}
        jobs = []
        for (_, problem), seed in zip(drawn, seeds):
            for j in range(g):
                eid = secrets.token_hex(16)  # the episode's URL is its credential
                self._server.open_episode(eid, params | {"seed": turn_seed(seed + j, 0)})  # turn k: + k
                jobs.append((eid, problem, problem.problem))
        timeout = ec.step_timeout_s * ec.max_turns
        pool = cf.ThreadPoolExecutor(max_workers=max(1, len(jobs)), thread_name_prefix="agent")
        try:
            futures = [pool.submit(self.fn, text, f"http://127.0.0.1:{self.port}/episodes/{eid}/v1")
                       for eid, _, text in jobs]
            deadline = time.monotonic() + timeout
            return [self._episode(eid, fut, deadline) for (eid, _, _), fut in zip(jobs, futures)]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _episode(self, eid: str, fut: cf.Future, deadline: float) -> Episode:
        end, answer, reward = "done", None, 0.0
        try:
            result = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            end = "env_timeout"
            log.warning("env=agent: an episode ran past env.step_timeout_s x env.max_turns; it is left out of the "
                        "loss (env/timeout_rate)")
        except Exception as e:  # noqa: BLE001 (the agent's bug ends its episode, not the run)
            end = "env_error"
            log.warning("env=agent: the agent raised %s: %s; its episode is left out of the loss (env/error_rate)",
                        type(e).__name__, e)
        else:
            if isinstance(result, str):
                answer = result
            elif isinstance(result, (int, float)) and not isinstance(result, bool):
                reward = float(result)
            else:
                end = "env_error"
                log.warning("env=agent: the agent returned %s, not the answer text or a float reward",
                            type(result).__name__)
        record = self._server.close_episode(eid)
        if record is None:  # no request reached the server: nothing to train on
            ep = Episode(None, [0], 0, end="env_error" if end == "done" else end)
            ep.outs = [{"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}]
            return ep
        return episode_from_session(record, answer, reward, end)


def episode_from_session(record: dict, answer: str | None, reward: float, end: str) -> Episode:
    """An `Episode` holding a server session's tokens (`serve.Session.record`): the first prompt's ids, then every
    token after it as one record (sampled tokens with their log-probs and versions; the other tokens log-prob 0 and
    the version of the token sampled before them), masked by the session's loss mask. When a turn filtered (top-p /
    top-k) the record carries the unfiltered log-probs too (`output_token_logprobs_unfiltered`, as an engine record
    does), which the loss takes (`trainer.batch.pack`). `answer`: graded by the run's reward (the episode's
    `graded`), else `reward` is the episode's."""
    p = len(record["prompt_ids"])
    ids, mask = list(record["ids"][p:]), list(record["loss_mask"][p:])
    versions, last = [], 0
    for v in record["weight_versions"][p:]:
        last = last if v is None else v
        versions.append(last)
    turns = record["turns"]
    finish = {"type": turns[-1]["finish_reason"]} if turns else {"type": "abort"}
    if record.get("end") == "truncated":
        end = "context" if end == "done" else end
    meta = {"finish_reason": finish, "weight_versions": sorted({v for t in turns for v in t["weight_versions"]}),
            "output_token_logprobs": [(lp, t) for lp, t in zip(record["logprobs"][p:], ids)],
            "output_token_weight_versions": versions}
    meta["weight_version"] = max(meta["weight_versions"], default=0)
    if any(t.get("filtered") for t in turns):
        meta["output_token_logprobs_unfiltered"] = list(record["unfiltered_logprobs"][p:])
    ep = Episode(None, list(record["prompt_ids"]), 0, outs=[{"output_ids": ids, "meta_info": meta}], starts=[p],
                 ids=ids, mask=mask, reward=reward, graded=answer is not None and end == "done", end=end,
                 answer=answer, turns=len(turns))
    return ep
