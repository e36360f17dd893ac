"""The seams of rollout production: what the training loop asks for a step (`RolloutSource`) and what plays a round
of episodes for a producer or an episode eval (`EpisodePlayer`).

Which producer runs, in which environment, is decided once, by `miles_k3.launch.build_rollouts` (the only reader
of rollout.mode and env.name at run time); the loop only calls

    samples, metrics = run.rollouts.collect(run.version)      # one step's samples, their versions checked
    ... run.rollouts.state()                                  # into every checkpoint (`checkpoint.rollout_checkpoint`)

The producers: `rollouts.SyncRollouts` (rollout.mode=sync: every sample drawn with the trainer's adapter, the
episodes played by the environment's turn loop through the engine, `TurnPlayer`), `partial.PartialRollouts`
(rollout.mode=partial: groups in flight across weight updates), `fleet.FleetRollouts` (rollout.mode=fleet: the
groups sampled by engine actors on Ray, under the partial-mode rules) and `miles_k3.agent.AgentRollouts`
(env=agent: sync rollouts whose episodes agent code plays over the in-process server; the player of its episode
evals too). A new producer (a fully asynchronous one, SFT data as rollouts) implements `RolloutSource` and gets a
branch in `build_rollouts`; nothing else in the loop changes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from miles_k3.envs.env import EnvConfig, EnvFactory
from miles_k3.evals.problems import Problem
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.episodes import Episode, first_turns, multi_turn, run_turns


class RolloutSource(Protocol):
    """A step's rollouts for the training loop, and their part of a checkpoint."""

    def collect(self, version: int) -> tuple[list[Sample], dict[str, float]]:
        """This rank's samples for the step that trains the adapter of weight `version` (rewards, group advantages,
        `Sample.group` numbered over the step's kept groups of every replica) and the step's rollout/ (env/)
        metrics, global over the replicas. RuntimeError when a sample breaks the producer's version rule (sync:
        every token drawn with `version`; partial: none newer, none older than rollout.partial.max_staleness)."""

    def state(self) -> dict:
        """This rank's state for a checkpoint, as plain data and host tensors (`torch.save`, loaded with
        weights_only): "mode" (the producer's kind: sync, partial), "stream" (the prompt stream's position) and what
        else it needs to continue exactly (partial: the groups in flight and the engine's queue). The checkpoint
        keeps mode and stream in state.json and anything else in the rank's rollout.pt
        (`checkpoint.rollout_checkpoint`; `rollout_state_of` gives it back)."""

    def load_state(self, state: dict) -> None:
        """Continue from a checkpoint's `state()` (ResumeError when this producer cannot, naming what can: a
        partial pool with groups in flight into a sync run)."""

    def close(self) -> None:
        """Stop what the producer started (the agent server); the engine is the run's."""


@dataclass(frozen=True)
class PlaySettings:
    """How a round of episodes samples (a RolloutConfig has these fields too): `group_size` episodes per problem,
    each turn's max_new_tokens, temperature, top_p and top_k; environments reset with `seed` and the draw, prompts
    rendered with `template` when the environment gives none."""

    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    template: str

    @classmethod
    def of_eval(cls, cfg) -> PlaySettings:
        """An episode eval's settings (`EvalConfig`: eval.samples episodes per problem)."""
        return cls(cfg.samples, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed, cfg.template)


class EpisodePlayer(ABC):
    """Plays a round of episodes: `play(drawn, seeds, settings)` returns `settings.group_size` episodes of each drawn
    (draw index, problem), in order (problem k's episode j at k * group_size + j), problem k's group sampled from
    seeds[k] (episode j: seeds[k] + j, its later turns `seeds.turn_seed`). `engine`, `tokenizer`, `env_cfg` and
    `lora`: the engine it samples with, its tokenizer, the environment's config and the adapter it serves."""

    engine: object
    tokenizer: object
    env_cfg: EnvConfig
    lora: str | None
    multi_turn: bool = True
    """Its episodes are an environment's other than `single`'s one graded turn: the producer logs their env/
    metrics."""

    @abstractmethod
    def play(self, drawn: list[tuple[int, Problem]], seeds: list[int], settings) -> list[Episode]:
        ...

    def close(self) -> None:
        """Stop what the player started."""


class TurnPlayer(EpisodePlayer):
    """Episodes of an environment (`factory`) through the engine: every group's first turn in one `generate` call,
    then a call per round of turns (`episodes.first_turns`, `episodes.run_turns`), on every rank of `ctx` together.
    `routes`: the samples carry the engine's routes."""

    def __init__(self, engine, tokenizer, factory: EnvFactory, env_cfg: EnvConfig, lora: str | None,
                 routes: bool = False, ctx: ParallelContext = SINGLE):
        self.engine, self.tokenizer, self.factory, self.env_cfg = engine, tokenizer, factory, env_cfg
        self.lora, self.routes, self.ctx = lora, routes, ctx
        self.multi_turn = multi_turn(factory)

    def play(self, drawn: list[tuple[int, Problem]], seeds: list[int], settings) -> list[Episode]:
        episodes = first_turns(self.engine, self.tokenizer, drawn, seeds, settings, self.factory, self.env_cfg,
                               self.lora, self.routes)
        run_turns(self.engine, self.tokenizer, episodes, settings, self.env_cfg, self.lora, self.routes, self.ctx)
        return episodes


def episode_player(env: tuple, engine, tokenizer, lora: str | None, routes: bool = False,
                   ctx: ParallelContext = SINGLE) -> EpisodePlayer:
    """What plays the episodes of `env` = (an environment factory, or an EpisodePlayer that plays them itself, such
    as env=agent's; their EnvConfig): a `TurnPlayer` over the factory, or the player, which must serve `lora`."""
    plays, env_cfg = env
    if not isinstance(plays, EpisodePlayer):
        return TurnPlayer(engine, tokenizer, plays, env_cfg, lora, routes, ctx)
    if plays.lora != lora:
        raise ValueError(f"env={env_cfg.name}: its episodes are played with adapter {plays.lora!r}, asked for "
                         f"{lora!r}")
    return plays
