"""Block-diffusion algorithms: how one round's logits fill (and edit) the positions of each block.

An algorithm implements two calls, and nothing about scheduling:
  init_state(block) -> its private state for a new block (None for a stateless algorithm);
  step(blocks, logits, states) -> per block, whether it is done; it writes the block's new ids
    into `blocks.ids` in place and may update the states (which travel opaquely, as msgspec
    Structs, between rounds: ipc/messages.DllmAlgoState).
They are registered by name and picked by --dllm-algorithm.

Every algorithm predicts one token per position: the most likely one (greedy requests) or one
drawn from the request's sampling parameters (temperature, top-k/top-p/min-p, seed), never the
mask id itself; its confidence is that token's probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ipc.messages import JointThresholdState, SamplingParams
from scheduler_proc.registry import Registry
from worker_proc.sampler import SamplingBatch, sample

DLLM_ALGORITHMS = Registry("diffusion algorithm")


@dataclass(slots=True)
class DllmAlgoConfig:
    mask_id: int
    block_size: int
    threshold: float = 0.95  # a masked position whose top token is at least this likely is filled
    edit_threshold: float = 0.9  # joint_threshold: a filled position changes to a new token this likely
    max_post_edit_steps: int = 4  # joint_threshold: edit-only rounds after the block's last mask


@dataclass(slots=True)
class DllmBlocks:
    """The blocks of one round: ids [N, B] (written in place by step), which positions hold
    prompt tokens [N, B], the absolute position of each block's first token, and each row's
    sampling parameters."""

    ids: torch.Tensor
    prompt_mask: torch.Tensor
    block_starts: torch.Tensor
    sampling: list[SamplingParams]


class DllmAlgorithm:
    def __init__(self, config: DllmAlgoConfig):
        self.config = config
        self.mask_id = config.mask_id

    def init_state(self, prompt_mask: list[bool]):
        return None

    def step(self, blocks: DllmBlocks, logits: torch.Tensor, states: list) -> list[bool]:
        raise NotImplementedError

    def predict(self, blocks: DllmBlocks, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position [N, B]: the predicted token and its probability. logits [N, B, V]."""
        n, b, v = logits.shape
        logits = logits.float().reshape(n * b, v)
        logits[:, self.mask_id] = -torch.inf  # a position is never "filled" with the mask
        if all(p.is_greedy for p in blocks.sampling):
            tokens = logits.argmax(dim=-1)
            probs = logits.softmax(dim=-1)
        else:
            per_token = [p for p in blocks.sampling for _ in range(b)]
            # a seeded request's noise depends on the position and how many masks its block has
            # left, so its tokens do not depend on the batch, the round count or the mode
            masks_left = (blocks.ids == self.mask_id).sum(dim=1)
            positions = blocks.block_starts[:, None] + torch.arange(b)[None, :]
            keys = (positions * (b + 1) + masks_left[:, None]).reshape(-1).tolist()
            sb = SamplingBatch.build(per_token, keys, v, logits.device)
            tokens = sample(logits, sb)
            probs = (logits / sb.temperatures[:, None]).softmax(dim=-1)
        confidence = probs.gather(1, tokens[:, None]).squeeze(1)
        return tokens.view(n, b), confidence.view(n, b)

    def fill_masks(self, blocks: DllmBlocks, tokens: torch.Tensor, confidence: torch.Tensor,
                   masked: torch.Tensor) -> None:
        """Fills every masked position whose confidence clears the threshold; a block where none
        does fills its single most confident masked position."""
        conf = confidence.masked_fill(~masked, -torch.inf)
        fill = conf > self.config.threshold
        stuck = masked.any(dim=1) & ~fill.any(dim=1)
        if stuck.any():
            rows = stuck.nonzero().squeeze(1)
            fill[rows, conf[rows].argmax(dim=1)] = True
        blocks.ids[fill] = tokens[fill]


@DLLM_ALGORITHMS.register("low_confidence")
class LowConfidence(DllmAlgorithm):
    """Fills confident masked positions (at least one per round); done when no mask is left."""

    def step(self, blocks: DllmBlocks, logits: torch.Tensor, states: list) -> list[bool]:
        masked = blocks.ids == self.mask_id
        tokens, confidence = self.predict(blocks, logits)
        self.fill_masks(blocks, tokens, confidence, masked)
        return (~(blocks.ids == self.mask_id).any(dim=1)).tolist()


@DLLM_ALGORITHMS.register("joint_threshold")
class JointThreshold(DllmAlgorithm):
    """Fills masked positions as low_confidence does, and edits filled output positions whose
    top token changed with probability above the edit threshold. After the block's last mask is
    filled it runs up to max_post_edit_steps edit-only rounds: done when no mask is left and a
    round made no edit, or the edit budget is spent."""

    def init_state(self, prompt_mask: list[bool]) -> JointThresholdState:
        return JointThresholdState(prompt_mask=list(prompt_mask))

    def step(self, blocks: DllmBlocks, logits: torch.Tensor, states: list[JointThresholdState]) -> list[bool]:
        masked = blocks.ids == self.mask_id
        tokens, confidence = self.predict(blocks, logits)
        prompt = torch.tensor([s.prompt_mask for s in states], dtype=torch.bool)
        edit = ~masked & ~prompt & (tokens != blocks.ids) & (confidence > self.config.edit_threshold)
        had_masks = masked.any(dim=1).tolist()
        self.fill_masks(blocks, tokens, confidence, masked)
        blocks.ids[edit] = tokens[edit]
        edits = edit.any(dim=1).tolist()
        left = (blocks.ids == self.mask_id).any(dim=1).tolist()
        done = []
        for state, had, edited, masks_left in zip(states, had_masks, edits, left):
            if not had:
                state.post_edit_steps += 1
            done.append(not masks_left and (not edited or state.post_edit_steps >= self.config.max_post_edit_steps))
        return done
