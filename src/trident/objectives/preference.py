"""Direct preference optimisation (``objective=dpo``, Rafailov et al. 2023) and its variants, as TRL's
``DPOTrainer`` computes them: IPO (Azar et al. 2023), the hinge loss (SLiC, Zhao et al. 2023) and the robust
DPO of noisy labels (Chowdhury et al. 2024, ``label_smoothing``).

A batch of B pairs (:class:`~trident.data.preference.PreferenceBatch`) runs as one batch of 2B sequences through the
policy, the task's trained network; each answer's log-probability is summed over its tokens only. The reference
policy is the initial weights, frozen (:meth:`DirectPreference.reference_logps`): where the task's converters can be
switched off (``finetune=lora``: its adapters), the same network with them off (no second copy of the weights);
in full fine-tuning the task's frozen companion :data:`REFERENCE`, a copy of the initial weights that the lifecycle
reads again from the run's ``<run>/init/reference.safetensors`` on a resume and shards like the policy
(trident.tasks.networks); or, with ``precompute_ref=true``, the log-probabilities computed once when training starts
and served with each batch (:meth:`DirectPreference.start`). The loss is summed over pairs and averaged over the
optimizer step's global batch of pairs (trident.training.token_loss: a pair is the "token").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trident.data.preference import Examples, PreferenceBatch, UnpairedBatch
from trident.data.special_tokens import IGNORE_INDEX
from trident.errors import ConfigError
from trident.objectives.base import Loss, Objective, Outputs, OutputSource

if TYPE_CHECKING:
    from omegaconf import DictConfig

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
#: The name of the frozen companion that holds the reference policy in full fine-tuning.
REFERENCE = "reference"
#: KTO's objective= name (trident.objectives.kto), which checks here name before that module is imported.
KTO = "kto"
# TRL's names for what a step logs beside the loss (logged as <split>/<name>).
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class PreferenceOutputs(Outputs):
    """The policy's outputs on the 2B sequences of a batch (chosen then rejected), their inputs, and the reference
    policy's log-probabilities of their answers."""

    inputs: Tensor  # (2B, T)
    reference: Tensor  # (2B,), or (0,) for an objective without a reference policy


def disable_dropout(net: nn.Module) -> None:
    """TRL's ``disable_dropout_in_model``: every ``nn.Dropout`` of the policy (the residual branches', LoRA's) at p=0,
    so that it is scored as the reference policy is, without dropout (at the initial weights: the same
    log-probabilities, a loss of log 2)."""
    for module in net.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def answer_logps(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """logits (N, T, V), targets (N, T) (IGNORE_INDEX off the answers) -> each sequence's answer log-probability
    (N,), in float32 at least, and its count of answer tokens (N,)."""
    scores = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    per_token = -F.cross_entropy(scores.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return per_token.view(targets.shape).sum(dim=1), targets.ne(IGNORE_INDEX).sum(dim=1)


class DirectPreference(Objective):
    """DPO and its variants on preference pairs; ``beta`` scales the implicit reward (IPO's regularisation tau)."""

    NAME = "dpo"
    PARTS = METRICS

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 precompute_ref: bool = False, disable_dropout: bool = True) -> None:
        super().__init__()
        if loss_type not in LOSS_TYPES:
            raise ConfigError(f"task.objective.loss_type={loss_type!r} is not a DPO loss: choose one of {', '.join(LOSS_TYPES)}")
        if not beta > 0:
            raise ConfigError(f"task.objective.beta={beta} must be positive (TRL's default is 0.1)")
        if not 0 <= label_smoothing < 0.5:
            raise ConfigError(f"task.objective.label_smoothing={label_smoothing} must lie in [0, 0.5): the assumed share "
                              "of pairs whose labels are flipped (loss_type=robust)")
        self.beta, self.loss_type, self.label_smoothing = float(beta), loss_type, float(label_smoothing)
        self.precompute_ref, self.disable_dropout = bool(precompute_ref), bool(disable_dropout)

    def copies_initial(self, switchable: bool) -> bool:
        """The reference policy is a frozen copy of the initial weights unless it is precomputed or the converters
        switch off."""
        return not self.precompute_ref and not switchable

    def start(self, task: Any) -> None:
        """When training starts, at the initial weights: with ``precompute_ref`` compute the reference
        log-probabilities of every pair of every split once (the policy itself then serves as reference, before its
        first step: no copy is kept). With ``disable_dropout`` (TRL's default) the policy trains without dropout."""
        if self.disable_dropout:
            disable_dropout(task.net)
        if not self.precompute_ref:
            return
        if task.switched_off() is None and task.trainer.ckpt_path is not None:  # the policy is no longer the initial one
            raise ConfigError("resuming a full fine-tuning DPO run with task.objective.precompute_ref=true would compute "
                              "its reference at the trained weights: start again from init_from, or train without "
                              "precompute_ref (its reference, a frozen copy of the initial weights, survives a resume)")
        data = task.trainer.datamodule
        for split in ("train", "validation", "test"):
            pairs = data.pairs[split]
            if isinstance(pairs, Examples):
                raise not_pairs(self.NAME, unpaired=True)
            pairs.reference = None  # the policy's own, not an earlier pass's
            loader = data.split_loader(split, train=False)
            # In the precision the steps run in (bf16-mixed: autocast), as a reference scored with each batch is.
            with task.trainer.precision_plugin.forward_context():
                found = [self.reference_logps(task, PreferenceBatch(*(t.to(task.device) for t in batch)), initial=True)
                         for batch in loader]
            pairs.reference = torch.cat([f.view(2, -1).T for f in found]).cpu()  # (N, 2): chosen, rejected

    def reference_logps(self, source: Any, batch: PreferenceBatch, initial: bool = False) -> Tensor:
        """The reference policy's answer log-probabilities (2B,): precomputed, or :func:`reference_policy_logps`."""
        if batch.reference.numel():
            return batch.reference
        return reference_policy_logps(source, batch.inputs, batch.targets, initial)

    def forward(self, source: OutputSource, batch: Any, stage: str) -> tuple[Loss, Outputs]:
        if not isinstance(batch, PreferenceBatch):
            raise not_pairs(self.NAME, isinstance(batch, UnpairedBatch))
        reference = self.reference_logps(source, batch)
        outputs = source.outputs((batch.inputs, batch.targets), stage)
        preference = PreferenceOutputs(outputs.logits, outputs.targets, batch.inputs, reference)
        return self.reduce(preference, stage), preference

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        """TRL's ``DPOTrainer`` loss and metrics, summed over the B pairs (the metrics as means over them)."""
        assert isinstance(outputs, PreferenceOutputs), "DirectPreference.forward makes its outputs"
        logps, lengths = answer_logps(outputs.logits, outputs.targets)  # (2B,), (2B,)
        chosen, rejected = logps.chunk(2)
        reference_chosen, reference_rejected = outputs.reference.to(logps.dtype).chunk(2)
        chosen_ratio, rejected_ratio = chosen - reference_chosen, rejected - reference_rejected  # (B,)
        delta = chosen_ratio - rejected_ratio
        if self.loss_type == "sigmoid":
            losses = -F.logsigmoid(self.beta * delta)
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - self.beta * delta)
        elif self.loss_type == "ipo":  # TRL's: the log-ratios per answer token (IPO's authors' normalisation)
            chosen_length, rejected_length = lengths.chunk(2)
            per_token = chosen_ratio / chosen_length.clamp(min=1) - rejected_ratio / rejected_length.clamp(min=1)
            losses = (per_token - 1 / (2 * self.beta)) ** 2
        else:  # robust: unbiased under a share label_smoothing of flipped labels
            epsilon = self.label_smoothing
            losses = (-(1 - epsilon) * F.logsigmoid(self.beta * delta)
                      + epsilon * F.logsigmoid(-self.beta * delta)) / (1 - 2 * epsilon)
        pairs = torch.tensor(losses.numel(), device=losses.device)
        chosen_rewards, rejected_rewards = self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach()
        means = (chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).to(logps.dtype),
                 chosen_rewards - rejected_rewards, chosen.detach(), rejected.detach())
        parts = {name: (values.mean(), pairs) for name, values in zip(METRICS, means, strict=True)}
        return Loss(losses.sum(), pairs, parts)


def not_pairs(name: str, unpaired: bool) -> ConfigError:
    """The one line for a pairwise objective given other batches: unpaired answers (KTO's rows), or not preferences."""
    if unpaired:
        return ConfigError(f"objective={name} trains on pairs of chosen and rejected answers, and data.files holds "
                           f"unpaired rows (prompt, completion, label): train them with objective={KTO}")
    return ConfigError(f"objective={name} trains on pairs of chosen and rejected answers: use data=preference")


def reference_policy_logps(source: Any, inputs: Tensor, targets: Tensor, initial: bool = False) -> Tensor:
    """inputs, targets (N, T) -> the reference policy's answer log-probabilities (N,): the frozen copy's, the policy's
    with its converters switched off, or (``initial``: before the first step) the policy's own; without dropout, as
    TRL runs both policies."""
    net = source.net
    was_training = net.training
    copied, off = source.companions.get(REFERENCE), source.switched_off()
    with torch.no_grad():
        try:
            net.eval()
            if copied is not None:
                logits = copied(inputs)
            elif off is not None:
                with off:
                    logits = source.outputs((inputs, targets), "val").logits
            elif initial:
                logits = source.outputs((inputs, targets), "val").logits
            else:
                raise ConfigError(f"objective={source.objective.NAME} has no reference policy here (full fine-tuning "
                                  "without task.reference, the frozen copy a run writes): evaluate a run's checkpoint "
                                  "with its config, or (objective=dpo) train with task.objective.precompute_ref=true")
        finally:
            net.train(was_training)
    return answer_logps(logits, targets)[0]


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2 (TRL's ORPO computes it so)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class OddsRatioPreference(Objective):
    """ORPO (Hong et al. 2024), as TRL's ``ORPOTrainer`` computes it: no reference policy; the chosen sequences'
    next-token NLL (prompt and answer: every token of the sequence) minus ``beta`` times the log-sigmoid of the
    log odds ratio of the answers' mean per-token log-probabilities. The NLL is the micro-batch's token mean, as
    TRL's; as a sum over pairs it is that mean times the pairs (so micro-batches weigh by their pairs)."""

    NAME = "orpo"
    PARTS = (*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")

    def __init__(self, beta: float = 0.1, disable_dropout: bool = True) -> None:
        super().__init__()
        if not beta > 0:
            raise ConfigError(f"task.objective.beta={beta} must be positive (TRL's ORPO default is 0.1)")
        self.beta, self.disable_dropout = float(beta), bool(disable_dropout)

    def start(self, task: Any) -> None:
        """With ``disable_dropout`` (TRL's default) the policy trains without dropout."""
        if self.disable_dropout:
            disable_dropout(task.net)

    def forward(self, source: OutputSource, batch: Any, stage: str) -> tuple[Loss, Outputs]:
        if not isinstance(batch, PreferenceBatch):
            raise not_pairs(self.NAME, isinstance(batch, UnpairedBatch))
        outputs = source.outputs((batch.inputs, batch.targets), stage)
        preference = PreferenceOutputs(outputs.logits, outputs.targets, batch.inputs, batch.reference)
        return self.reduce(preference, stage), preference

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        assert isinstance(outputs, PreferenceOutputs), "OddsRatioPreference.forward makes its outputs"
        logits, targets, inputs = outputs.logits, outputs.targets, outputs.inputs  # (2B, T, V), (2B, T), (2B, T)
        summed, lengths = answer_logps(logits, targets)
        chosen, rejected = (summed / lengths.clamp(min=1)).chunk(2)  # (B,) mean log-probability per answer token
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        # The chosen sequences' every next token: the answer ends each, so position j trains up to its last target.
        chosen_logits, chosen_targets = logits.chunk(2)[0], targets.chunk(2)[0]
        positions = torch.arange(chosen_targets.size(1), device=targets.device)
        last = torch.where(chosen_targets.ne(IGNORE_INDEX), positions, -1).amax(dim=1, keepdim=True)  # (B, 1)
        nexts = torch.cat([inputs.chunk(2)[0][:, 1:], inputs.new_zeros(inputs.size(0) // 2, 1)], dim=1)
        whole = torch.where(positions <= last, nexts, IGNORE_INDEX)
        scores = chosen_logits if chosen_logits.dtype in (torch.float32, torch.float64) else chosen_logits.float()
        nll = F.cross_entropy(scores.flatten(0, 1), whole.flatten(), ignore_index=IGNORE_INDEX)
        pairs = torch.tensor(ratio.numel(), device=ratio.device)
        loss = (nll - self.beta * ratio.mean()) * ratio.numel()
        chosen_rewards, rejected_rewards = self.beta * chosen.detach(), self.beta * rejected.detach()
        means = (chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).to(chosen.dtype),
                 chosen_rewards - rejected_rewards, chosen.detach(), rejected.detach())
        parts = {name: (values.mean(), pairs) for name, values in zip(METRICS, means, strict=True)}
        extra = (nll.detach(), ratio.detach().mean(), log_odds.detach().mean())
        parts |= {name: (value, pairs) for name, value in zip(self.PARTS[len(METRICS):], extra, strict=True)}
        return Loss(loss, pairs, parts)


def check_preference_run(cfg: DictConfig) -> None:
    """A preference objective and ``data=preference`` go together, and DPO and KTO start from trained weights (their
    reference policy): one line each, before any work."""
    name = (cfg.task.get("objective") or {}).get("name")
    dpo = name in (DirectPreference.NAME, KTO)  # the objectives of a reference policy
    preference = cfg.data.get("name") == "preference"
    if name in PREFERENCE_OBJECTIVES and not preference:
        raise ConfigError(f"objective={name} trains on pairs of chosen and rejected answers, not data={cfg.data.name}: "
                          "use data=preference data.files=[...]")
    if preference and name not in PREFERENCE_OBJECTIVES:
        raise ConfigError("data=preference holds pairs of answers, which only a preference objective trains on: "
                          f"add objective={' or objective='.join(PREFERENCE_OBJECTIVES)}")
    if dpo and not cfg.get("init_from"):
        raise ConfigError(f"objective={name} starts from trained weights, its reference policy: give init_from=<an SFT run, a "
                          "LoRA run or a Hugging Face directory>")
    if dpo and cfg.get("finetune", {}).get("adapter"):
        raise ConfigError(f"objective={name} with finetune.adapter=<a LoRA run> would take the base without that adapter as its "
                          "reference policy (the adapters switched off): give init_from=<that LoRA run> instead, whose "
                          "adapters are merged into the initial weights, and new adapters train on them")


#: The objectives that train on data=preference.
PREFERENCE_OBJECTIVES = (DirectPreference.NAME, OddsRatioPreference.NAME, KTO)
