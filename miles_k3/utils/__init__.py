"""Utilities every layer but the kernels may use, importing no other unit of `miles_k3`: atomic writes
(`atomic`), the device and logging setup (`runtime`), metrics to W&B and the run directory (`tracking`),
the one-function-per-name rule of the registries (`registry`)."""
