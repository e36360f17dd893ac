"""Multi-turn environments and their tools: an episode is a conversation between the policy and an environment,
token in / token out (`env.py`); tools (`tools.py`) answer the policy's tool calls, the Python tool only in a
bubblewrap sandbox (`sandbox.py`: its own PID, network and mount namespaces, a read-only system view, limits)."""
