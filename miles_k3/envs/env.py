"""Environments: a rollout is an episode of turns between the policy and an environment, registered by name.

An environment subclasses `Environment`; one is made fresh for every episode (`build_env(cfg)` returns its
factory). The trainer calls:

    reset(problem, rng) -> str | None     the episode's first prompt text (None: the rollout template's rendering
                                          of the problem, as a single-turn rollout has it)
    step(turn) -> StepResult              the policy's turn (its text); the observation to append, a reward, done
    cancel()                              from another thread, when a step runs past env.step_timeout_s: make it
                                          return or raise promptly (default: nothing; the step is left to finish
                                          and its result is discarded)
    replay(turn, result)                  on resume (rollout.mode=partial): the environment, reset as at its draw,
                                          is told each turn it answered before the checkpoint and the answer it
                                          gave (recorded then); `step` is never run again for a turn (default:
                                          nothing, for an environment whose answers do not depend on earlier turns)

`StepResult.observation` is text (tokenised on its own and appended as ids after the policy's tokens: the policy's
tokens are never re-tokenised) or token ids. `StepResult.reward` is added to the episode's reward; on the final
step None means "grade the final turn with the run's reward (reward.name) against the problem's answer", which is
what the one-step `single` environment (the default: one prompt, one response) returns. An episode ends when a
step says done, at env.max_turns policy turns, when its tokens reach env.max_total_tokens (or the engine's
context), or when the environment raises or runs past env.step_timeout_s (the episode is then left out of the loss
and counted in env/error_rate or env/timeout_rate; the run goes on). A turn cut by rollout.max_new_tokens does not
end its episode: the environment answers it as any other (rollout.overlong judges each turn against that cap). The
environments of a round's episodes step at once, each in a thread of its own, its time counted from when its own
step starts.

Built in:
* single: one turn, graded by the reward (the default);
* guess: guess the number (the problem's answer, an integer) with "higher" / "lower" after each wrong guess;
  reward 1 for finding it;
* agent: agent code written against the OpenAI client plays the episodes over an in-process server
  (`miles_k3.agent`; env.agent=MODULE:FUNCTION);
* tools: the policy may call the tools of env.tools (`tools.py`: `<tool_call>{"name": ..., "arguments": ...}`
  `</tool_call>`); each call's result comes back as `<tool_response>...</tool_response>`; the first turn without a
  call is the answer, graded by the reward. A call that does not parse, or a tool that fails, is an observation
  saying so.
"""
from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from miles_k3.envs import sandbox
from miles_k3.envs.sandbox import SandboxLimits
from miles_k3.envs.tools import TOOL_NAMES, ToolCallError, build_tools, parse_tool_calls, run_tool_call
from miles_k3.evals.problems import Problem


@dataclass
class StepResult:
    """What the environment answers to one policy turn."""

    observation: str | list[int] = ""
    """Appended after the turn (text is tokenised on its own; ids go in as they are); ignored when done."""
    reward: float | None = 0.0
    """Added to the episode's reward; None (final step only): grade the final turn with the run's reward."""
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)
    """Numbers summed over the episode and logged as env/<key> (per-episode means), e.g. tool_calls."""


class Environment:
    """What an episode's environment answers (subclass it; see the module docstring). `reset` and `step` run in a
    thread of the trainer's (a step in one of its own, unless `instant_step`); `cancel` is called from another
    thread."""

    instant_step: bool = False
    """True for an environment whose `step` returns at once, computing nothing (`Single`): it runs in the trainer's
    thread, with no thread of its own and no deadline to watch."""

    def reset(self, problem: Problem, rng: random.Random) -> str | None:
        """The episode's first prompt text, or None for the rollout template's rendering of the problem. Every member
        of a GRPO group gets the same rng seed and must give the same prompt."""
        raise NotImplementedError

    def step(self, turn: str) -> StepResult:
        """The answer to the policy's turn (its text, decoded from the tokens it sampled)."""
        raise NotImplementedError

    def cancel(self) -> None:
        """Called from another thread while `step` runs past env.step_timeout_s: make that step return or raise
        promptly (kill the process it waits on, close its connection). Its result is discarded either way and the
        episode ends (env/timeout_rate). Default: nothing; the step runs on in its thread until it ends by itself."""

    def replay(self, turn: str, result: StepResult) -> None:
        """Resume: bring this environment, just reset as at the episode's draw, to where it was after answering
        `turn` with `result` (recorded when `step` ran), without running the step again (its tool calls, programs
        or requests are not repeated). Called for each turn of an episode in flight at a checkpoint, in order.
        Default: nothing, right for an environment whose answers do not depend on its earlier turns; one that keeps
        state across turns overrides it (`Guess` remembers the guess)."""


@dataclass
class EnvConfig:
    """The rollout's environment (`env=NAME`): one turn graded by the reward (single), or a multi-turn episode."""

    name: str = "single"
    """A registered environment: single (one prompt, one response), guess (guess the number with higher/lower
    feedback), tools (tool calls answered by env.tools), or one added by register_env."""
    max_turns: int = 1
    """Policy turns per episode at most (single: 1)."""
    max_total_tokens: int = 0
    """Prompt + all turns + observations at most; 0: the engine's max_context."""
    step_timeout_s: float = 10.0
    """Seconds one environment step may take, counted from when that step starts; past it the step is cancelled
    (`Environment.cancel`: a running sandbox is killed) and its episode ends (env/timeout_rate), the run goes on."""
    keep_state: bool = True
    """Multi-turn episodes keep each episode's KDA state and MLA latent pages in the engine between its turns, so a
    turn prefills only its new tokens (engine.backend=native; false: every turn recomputes the whole conversation,
    as SGLang's offline engine does)."""
    agent: str = ""
    """env=agent: MODULE:FUNCTION of agent code written against the OpenAI client, called once per episode with
    (problem text, base_url) and returning its answer text (graded by the reward) or a float reward
    (`miles_k3.agent`)."""
    tools: list[str] = field(default_factory=list)
    """env=tools: the tools the policy may call (calculator; python runs model-written code in a bubblewrap
    sandbox, env.sandbox, and is off unless listed)."""
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    """env.tools=[python]: the limits of each call's sandbox (CPU, memory, processes, file size, scratch space,
    wall time, output); with the python tool, env.step_timeout_s must be at least 3 x env.sandbox.wall_s."""

    def validate(self) -> None:
        if self.name not in _ENVS:
            raise ValueError(f"name: '{self.name}' is not a registered environment; registered: "
                             f"{', '.join(env_names())}")
        if isinstance(self.max_turns, bool) or self.max_turns < 1:
            raise ValueError(f"max_turns: must be >= 1, got {self.max_turns!r}")
        if self.name == "single" and self.max_turns != 1:
            raise ValueError(f"max_turns: env=single has one turn, got {self.max_turns}; pick a multi-turn env "
                             "(guess, tools) or leave env.max_turns=1")
        if self.max_total_tokens < 0:
            raise ValueError(f"max_total_tokens: must be >= 0 (0: the engine's context), got {self.max_total_tokens}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s: must be > 0 seconds, got {self.step_timeout_s}")
        if (self.name == "tools") != bool(self.tools):
            raise ValueError("tools: env=tools needs at least one tool (env.tools=[calculator])" if self.name == "tools"
                             else f"tools: env.tools is set but env={self.name} calls no tools; set env=tools or "
                                  "leave env.tools empty")
        if (self.name == "agent") != bool(self.agent):
            raise ValueError("agent: env=agent needs env.agent=MODULE:FUNCTION (the agent code to run per episode)"
                             if self.name == "agent" else
                             f"agent: env.agent is set but env={self.name} runs no agent code; set env=agent")
        if self.tools:
            for t in self.tools:
                if t not in TOOL_NAMES:
                    raise ValueError(f"tools: '{t}' is not a tool; known: {', '.join(TOOL_NAMES)}")
        if "python" in self.tools:
            self._check_python_tool()

    def _check_python_tool(self) -> None:
        """The step timeout holds PYTHON_CALLS_PER_STEP sandboxed calls, and the sandbox starts on this machine."""
        need = PYTHON_CALLS_PER_STEP * self.sandbox.wall_s
        if self.step_timeout_s < need:
            raise ValueError(f"step_timeout_s: {self.step_timeout_s:g} s holds fewer than {PYTHON_CALLS_PER_STEP} "
                             f"python calls of env.sandbox.wall_s={self.sandbox.wall_s:g} s (a turn's calls run one "
                             f"after another in one step); set env.step_timeout_s >= {need:g} or lower "
                             "env.sandbox.wall_s")
        reason = sandbox.unavailable_reason()
        if reason is not None:
            raise ValueError(f"tools: python: {reason}")


PYTHON_CALLS_PER_STEP = 3
"""With the python tool, env.step_timeout_s must be at least this many env.sandbox.wall_s: room for several calls."""


EnvFactory = Callable[[], Environment]
_ENVS: dict[str, Callable[[EnvConfig], EnvFactory]] = {}


def register_env(name: str) -> Callable:
    """Decorator: register `factory(cfg: EnvConfig) -> (() -> Environment)` as environment `name`."""
    def deco(factory):
        old = _ENVS.get(name)
        if old is not None and old.__qualname__ != factory.__qualname__:
            raise ValueError(f"environment '{name}' is already registered; pick another name")
        _ENVS[name] = factory
        return factory
    return deco


def env_names() -> list[str]:
    return sorted(_ENVS)


def build_env(cfg: EnvConfig) -> EnvFactory:
    """The factory of fresh environments for `cfg` (validated first)."""
    cfg.validate()
    return _ENVS[cfg.name](cfg)


class Single(Environment):
    """One prompt (the rollout template's), one response, graded by the run's reward."""

    instant_step = True

    def reset(self, problem: Problem, rng: random.Random) -> str | None:
        return None

    def step(self, turn: str) -> StepResult:
        return StepResult(reward=None, done=True)


@register_env("single")
def _single(cfg: EnvConfig) -> EnvFactory:
    return Single


_INT = re.compile(r"-?\d+")


class Guess(Environment):
    """Guess the number: the problem's answer (an integer) is the secret; the problem's text is the prompt. Each
    turn's first integer is the guess: "higher" or "lower" comes back after a wrong one, "not a number" after a
    turn with none; reward 1 when found (0 if the turns run out). Info: `invalid` (a turn with no number) and
    `repeats` (a wrong guess made again: a wasted turn)."""

    def reset(self, problem: Problem, rng: random.Random) -> str | None:
        try:
            self.secret = int(problem.answer)
        except ValueError:
            raise ValueError(f"env=guess: problem {problem.id}'s answer {problem.answer!r} is not an integer") from None
        self.guessed: set[int] = set()
        return problem.problem

    def step(self, turn: str) -> StepResult:
        m = _INT.search(turn)
        if m is None:
            return StepResult(" not a number\n", 0.0, info={"invalid": 1.0})
        guess = int(m.group())
        if guess == self.secret:
            return StepResult(reward=1.0, done=True)
        info = {"repeats": 1.0} if guess in self.guessed else {}
        self.guessed.add(guess)
        return StepResult(" higher\n" if guess < self.secret else " lower\n", 0.0, info=info)

    def replay(self, turn: str, result: StepResult) -> None:
        m = _INT.search(turn)
        if m is not None:  # the only state a step keeps: the guesses made
            self.guessed.add(int(m.group()))


@register_env("guess")
def _guess(cfg: EnvConfig) -> EnvFactory:
    return Guess


class Tools(Environment):
    """Tool calls in a turn are answered, each as `<tool_response>...</tool_response>`; a turn with no call is the
    final answer, graded by the run's reward."""

    def __init__(self, tools: dict):
        self.tools = tools
        self._cancel = threading.Event()

    def reset(self, problem: Problem, rng: random.Random) -> str | None:
        return None

    def step(self, turn: str) -> StepResult:
        calls = parse_tool_calls(turn)
        if not calls:
            return StepResult(reward=None, done=True)
        bad = sum(isinstance(c, ToolCallError) for c in calls)
        text = "".join(f"<tool_response>{run_tool_call(c, self.tools, self._cancel)}</tool_response>" for c in calls)
        return StepResult("\n" + text + "\n", 0.0, info={"tool_calls": float(len(calls)), "tool_call_errors": float(bad)})

    def cancel(self) -> None:
        """End this episode's tool calls: the python call running now is killed at once (every process of its
        sandbox dead) and later python calls do not start ("exit: cancelled"), so the step returns promptly."""
        self._cancel.set()


@register_env("tools")
def _tools(cfg: EnvConfig) -> EnvFactory:
    tools = build_tools(list(cfg.tools), cfg.sandbox)  # unknown names and an unavailable sandbox fail here
    return lambda: Tools(tools)


@register_env("agent")
def _agent(cfg: EnvConfig) -> EnvFactory:
    def refuse():
        raise RuntimeError("env=agent has no per-episode environment: the training loop's agent runner "
                           "(miles_k3.agent.AgentRollouts) plays its episodes")
    return refuse
