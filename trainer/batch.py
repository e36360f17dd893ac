"""Rollout samples as training tensors: padded token batches with a response mask, and micro-batches by token
budget.

A `Sample` is one completion of one prompt (its prompt and response token ids, the engine's per-token logprobs,
its reward and advantage). `pack(samples, pad_id, vocab_size)` lays them out left-aligned in [B, T] with T the longest
prompt + response - 1: row b holds tokens x_0 .. x_{L_b - 2} of its sequence (prompt then response), and
`targets_BT[b, t] = x_{t+1}`, so the logits at position t score the target at t. `mask_BT` is 1 exactly where
the target is a response token (of a sample that is `in_loss`) that the policy sampled (`Sample.loss_mask`: a
multi-turn episode's observation tokens are context, 0). `rollout_logp_BT` holds the engine's log-probs
of the policy it sampled from: the unfiltered ones when top-p / top-k filtered the sampling (the trainer's
log-probs are over the whole vocabulary, so the PPO old policy, TIS and the gap metric compare like with like),
else the sampling ones. `pack` is where a step's token ids and log-prob counts are checked (on the host, before
the batch moves to the device): the loss path checks nothing per micro-batch that would sync with the device. `micro_batches(samples, max_tokens)` splits a step's samples into groups whose
padded size (rows x longest row) stays within the budget, in their original order.

A sample may carry the engine's routes (`routed_experts`: the top-k expert ids of every MoE layer at each of its
P + R - 1 positions, `miles_k3.model.routing`); `pack` lays them out as `routes_BTLK` when every sample has them,
padding positions holding -1 (no route: a replaying forward routes them by its own top-k; their outputs are masked).

Legend: B samples, T positions (longest sequence - 1), V vocabulary, L MoE layers, K experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    """One rollout completion and what the trainer needs of it."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float] = field(default_factory=list)  # the engine's, one per response token
    reward: float = 0.0
    advantage: float = 0.0
    weight_version: int = 0  # the oldest engine weight version any of its tokens was sampled with
    truncated: bool = False  # stopped by max_new_tokens
    group: int = 0  # the index of its prompt in the step (GRPO group)
    in_loss: bool = True  # False: left out of the loss, its normalisers and its group's baseline (overlong=mask)
    old_logprobs: list[float] = field(default_factory=list)  # the policy's before the step's first update
    weight_version_max: int = 0  # the newest one it saw (== weight_version unless a push came mid-sample)
    unfiltered_logprobs: list[float] = field(default_factory=list)  # engine log-probs under the unfiltered
    # distribution, reported only when top-p / top-k filtered the sampling (rollout_logprobs are the filtered ones)
    routed_experts: torch.Tensor | None = None  # the engine's routes [P + R - 1, L, K] int16 (host), if returned
    token_versions: list[int] = field(default_factory=list)  # the weight version that sampled each response token
    # (native engine; rollout.mode=partial samples may span versions)
    loss_mask: list[int] = field(default_factory=list)  # per response token, 1: sampled by the policy, 0: an
    # environment's observation in a multi-turn episode (context only, not trained); empty: all 1
    reward_failed: bool = False  # no reward could be computed (a remote judge's failure): out of the loss, and
    # out of rollout/reward_mean (counted in rollout/reward_failed)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Response tokens the loss scores: the policy's (a multi-turn episode's observations are not)."""
        return sum(self.loss_mask) if self.loss_mask else len(self.response_ids)


@dataclass
class TrainBatch:
    input_ids_BT: torch.Tensor  # int64
    seq_lens_B: torch.Tensor  # int64: real positions per row (length - 1)
    targets_BT: torch.Tensor  # int64: the next token at each position (pad where none)
    mask_BT: torch.Tensor  # float32: 1 where the target is a response token
    rollout_logp_BT: torch.Tensor  # float32: the engine's (unfiltered, when it filtered) logprob of each response
    # target (0 elsewhere)
    adv_B: torch.Tensor  # float32
    old_logp_BT: torch.Tensor  # float32: Sample.old_logprobs of each response target (0 elsewhere or when none)
    routes_BTLK: torch.Tensor | None = None  # int16: the engine's routes of each position (None: not every sample
    # has them)

    @property
    def num_tokens(self) -> int:
        return int(self.mask_BT.sum().item())

    @property
    def routes_NLK(self) -> torch.Tensor | None:
        """The routes in a forward's token order (B * T flattened), or None."""
        r = self.routes_BTLK
        return None if r is None else r.reshape(-1, *r.shape[2:])

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(*(None if getattr(self, f) is None else getattr(self, f).to(device)
                            for f in self.__dataclass_fields__))


def pack(samples: list[Sample], pad_id: int, vocab_size: int) -> TrainBatch:
    """The samples as one left-aligned, right-padded batch (see the module docstring). Raises ValueError naming
    the sample (and the position of a token id) for a sample the trainer cannot score: an empty prompt or
    response, a token id or pad_id outside [0, vocab_size), log-prob or route counts that do not match."""
    if not samples:
        raise ValueError("pack: no samples")
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pack: pad_id {pad_id} is outside the vocabulary [0, {vocab_size})")
    for i, s in enumerate(samples):
        _check_sample(i, s, vocab_size)
    t = max(s.length for s in samples) - 1
    b = len(samples)
    ids = torch.full((b, t), pad_id, dtype=torch.int64)
    targets = torch.full((b, t), pad_id, dtype=torch.int64)
    mask = torch.zeros(b, t)
    rollout = torch.zeros(b, t)
    old = torch.zeros(b, t)
    for row, s in enumerate(samples):
        seq = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.int64)
        n, p = len(seq) - 1, len(s.prompt_ids)
        ids[row, :n], targets[row, :n] = seq[:-1], seq[1:]
        mask[row, p - 1:n] = 1.0 if s.in_loss else 0.0  # position p - 1 scores the first response token
        if s.loss_mask and s.in_loss:  # a multi-turn episode: its observations are context, not trained
            mask[row, p - 1:n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        engine_logprobs = s.unfiltered_logprobs or s.rollout_logprobs
        if engine_logprobs:
            rollout[row, p - 1:n] = torch.tensor(engine_logprobs, dtype=torch.float32)
        if s.old_logprobs:
            old[row, p - 1:n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    lens = torch.tensor([s.length - 1 for s in samples], dtype=torch.int64)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return TrainBatch(ids, lens, targets, mask, rollout, adv, old, _pack_routes(samples, t))


def _pack_routes(samples: list[Sample], t: int) -> torch.Tensor | None:
    """routes_BTLK of `samples` (None unless every sample has routes); padding positions hold -1 (no route).
    A replaying forward routes those by its own top-k, as it would without replay: forced experts there would change
    which tokens each expert's GEMM takes, and so its fp32 rounding, though their outputs are masked."""
    if any(s.routed_experts is None for s in samples):
        return None
    first = samples[0].routed_experts
    out = torch.full((len(samples), t, *first.shape[1:]), -1, dtype=first.dtype)
    for row, s in enumerate(samples):
        out[row, :s.length - 1] = s.routed_experts
    return out


def _check_sample(i: int, s: Sample, vocab_size: int) -> None:
    if not s.prompt_ids or not s.response_ids:
        raise ValueError(f"sample {i}: needs a non-empty prompt and response, got {len(s.prompt_ids)} prompt and "
                         f"{len(s.response_ids)} response tokens")
    for pos, t in enumerate(s.prompt_ids + s.response_ids):
        if not 0 <= t < vocab_size:
            part = f"prompt position {pos}" if pos < len(s.prompt_ids) else \
                f"response position {pos - len(s.prompt_ids)}"
            raise ValueError(f"sample {i}: token id {t} at {part} is outside the model's vocabulary [0, {vocab_size}) "
                             "(a tokenizer that does not match the model?)")
    if s.loss_mask and len(s.loss_mask) != len(s.response_ids):
        raise ValueError(f"sample {i}: a loss mask of {len(s.loss_mask)} for its {len(s.response_ids)} response tokens")
    r = s.routed_experts
    if r is not None and (r.ndim != 3 or r.shape[0] != s.length - 1):
        raise ValueError(f"sample {i}: routed_experts of shape {tuple(r.shape)}; its prompt + response - 1 = "
                         f"{s.length - 1} positions need [{s.length - 1}, MoE layers, top_k]")
    if s.rollout_logprobs and len(s.rollout_logprobs) != len(s.response_ids):
        raise ValueError(f"sample {i}: {len(s.rollout_logprobs)} rollout logprobs for {len(s.response_ids)} "
                         "response tokens (the engine returns one per generated token)")
    if s.unfiltered_logprobs and len(s.unfiltered_logprobs) != len(s.response_ids):
        raise ValueError(f"sample {i}: {len(s.unfiltered_logprobs)} unfiltered logprobs for {len(s.response_ids)} "
                         "response tokens (the engine returns one per generated token)")
    if s.old_logprobs and len(s.old_logprobs) != len(s.response_ids):
        raise ValueError(f"sample {i}: {len(s.old_logprobs)} old logprobs for {len(s.response_ids)} response tokens")


def micro_batches(samples: list[Sample], max_tokens: int) -> list[list[int]]:
    """Indices of `samples` split in order into micro-batches of padded size (rows x longest row) <= max_tokens;
    a sample longer than the budget alone is a micro-batch of its own."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, s in enumerate(samples):
        grown = max(longest, s.length - 1)
        if current and grown * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, grown = [], s.length - 1
        current.append(i)
        longest = grown
    if current:
        groups.append(current)
    return groups
