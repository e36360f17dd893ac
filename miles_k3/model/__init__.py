"""The Kimi K3 model in PyTorch: config (published key names), layers, and the causal LM with its full-sequence
and stateful-step forward modes."""
from miles_k3.model.config import SHIPPED_CONFIGS, ConfigError, K3Config
from miles_k3.model.k3 import CHECKPOINT_PREFIX, K3ForCausalLM, K3Output
from miles_k3.model.state import K3State, KDALayerState, MLALayerState

__all__ = [
           "CHECKPOINT_PREFIX",
           "SHIPPED_CONFIGS",
           "ConfigError",
           "K3Config",
           "K3ForCausalLM",
           "K3Output",
           "K3State",
           "KDALayerState",
           "MLALayerState",
]
