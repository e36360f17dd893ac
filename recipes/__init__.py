"""Hydra config root: `train.yaml` and the config groups (`recipe/`, `model/`, ...). Shipped as package data."""
