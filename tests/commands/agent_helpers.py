"""Agent functions for tests/commands/test_agent.py (env.agent=agent_helpers:NAME): code written against the
OpenAI client, as a user's agent would be."""
import time

import openai

FOLLOW_UP = "Check:"


def two_turns(problem: str, base_url: str) -> str:
    """Asks the problem, then follows up on the reply; returns the second reply's text. It asks for sampling
    settings of its own (temperature 5, 99 tokens), which the trainer's replace."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": problem}]
    first = client.chat.completions.create(model="policy", messages=messages, temperature=5.0, max_tokens=99)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": FOLLOW_UP}]
    second = client.chat.completions.create(model="policy", messages=messages, temperature=5.0, max_tokens=99)
    return second.choices[0].message.content


def raises(problem: str, base_url: str) -> str:
    raise RuntimeError("the agent's own bug")


def never_calls(problem: str, base_url: str) -> str:
    return "42"


def too_slow(problem: str, base_url: str) -> str:
    time.sleep(3)
    return "42"


def returns_a_reward(problem: str, base_url: str) -> float:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": problem}])
    return 0.25


ANSWERS = {"2+3=": "5", "15-43=": "-99"}
"""What `two_turns_then_answers` returns per problem: right for 2+3=, wrong for 15-43= (its gold is -28)."""


def two_turns_then_answers(problem: str, base_url: str) -> str:
    """Plays `two_turns` (its reply is ignored), then answers from a table: a known score per problem."""
    two_turns(problem, base_url)
    return ANSWERS[problem]
