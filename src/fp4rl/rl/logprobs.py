"""Log-probabilities of response tokens under a policy (the training side of GRPO): the
function lives beside the engines (:mod:`fp4rl.rollout.logprobs`), which every host's
scoring shares (the trainer's, TRL's)."""

from fp4rl.rollout.logprobs import response_logprobs

__all__ = ["response_logprobs"]
