"""The eval harness (`miles_k3.evals`): AIME and other datasets, graders, avg@k / pass@k / maj@k, reports."""
