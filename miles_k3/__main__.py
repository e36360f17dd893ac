"""`python -m miles_k3`: the package's commands, one line each (console script, module, what it does)."""
import miles_k3

COMMANDS = (
    ("miles-k3-train", "miles_k3.train", "LoRA GRPO on a frozen MXFP4 K3 base (--help)"),
    ("miles-k3-eval", "miles_k3.eval", "evaluate a model (+ adapter) on a dataset (--help)"),
    ("miles-k3-sft", "miles_k3.sft", "supervised fine-tuning, full or LoRA (--help)"),
    ("miles-k3-grade", "miles_k3.grade", "regrade saved responses (--help)"),
    ("", "miles_k3.serve", "OpenAI-compatible endpoint with token-exact sessions (--help; the serve extra)"),
    ("", "miles_k3.init_checkpoint", "random-init checkpoint of a K3 config (--help)"),
    ("", "miles_k3.model_info", "sizing figures of a K3 config as JSON (--help)"),
    ("", "miles_k3.quantize", "bf16 K3 checkpoint -> MXFP4 routed experts (--help)"),
)
"""(console script or "" for a module-only command, module run by `python -m`, one line on what it does)."""


def main() -> None:
    print(f"miles_k3 {miles_k3.__version__}: LoRA RL on a frozen, natively MXFP4 Kimi K3 base. Commands:")
    for script, module, what in COMMANDS:
        print(f"  {script:<15} python -m {module:<25} {what}")


if __name__ == "__main__":
    main()
