"""Training-step rows: trident against timm's ViT, ``nn.TransformerEncoder`` and ``nn.Transformer``
of identical shape, and bf16 against fp32. Every pair shares dropout, norm placement, dtype,
optimizer (fused AdamW) and batches."""

from __future__ import annotations

from collections.abc import Callable

import timm
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trident.backbone import TransformerConfig
from trident.bench.references import TorchEncoderLM, TorchTranslation
from trident.bench.results import Row, Settings, milliseconds, speedup, verdict
from trident.bench.timing import Budget, interleaved, training_step
from trident.models import CausalLM
from trident.models.seq2seq import EncoderDecoder
from trident.models.vit import VisionTransformer, vit_geometry

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VOCAB = 8000


def _budget(settings: Settings) -> Budget:
    return Budget(settings.warmup, settings.repeats)


def _vit_pair(shape: dict[str, int], device: torch.device) -> tuple[nn.Module, nn.Module]:
    geometry = vit_geometry(shape["image"], shape["patch"], "cls")
    cfg = TransformerConfig(
        d_model=shape["d"], n_heads=shape["heads"], n_layers=shape["layers"], d_ff=4 * shape["d"], dropout=0.0,
        pos_encoding="learned", norm_eps=1e-6, **geometry,
    )
    ours = VisionTransformer(cfg, patch_size=shape["patch"], in_channels=3, num_classes=shape["classes"])
    theirs = timm.models.vision_transformer.VisionTransformer(
        img_size=shape["image"], patch_size=shape["patch"], in_chans=3, num_classes=shape["classes"],
        embed_dim=shape["d"], depth=shape["layers"], num_heads=shape["heads"], mlp_ratio=4.0,
    )
    return ours.to(device), theirs.to(device)


VIT_SHAPES = {
    "vit_small": {"image": 32, "patch": 4, "d": 192, "heads": 3, "layers": 6, "classes": 10, "batch": 32},
    "vit_b16": {"image": 224, "patch": 16, "d": 768, "heads": 12, "layers": 12, "classes": 1000, "batch": 2},
}
VIT_QUICK = {"image": 16, "patch": 4, "d": 32, "heads": 2, "layers": 1, "classes": 10, "batch": 2}


def vit_rows(name: str) -> Callable[[Settings], list[Row]]:
    def rows(settings: Settings) -> list[Row]:
        shape = VIT_QUICK if settings.quick else VIT_SHAPES[name]
        device = settings.device
        ours, theirs = _vit_pair(shape, device)
        images = torch.randn(shape["batch"], 3, shape["image"], shape["image"], device=device)
        labels = torch.randint(0, shape["classes"], (shape["batch"],), device=device)
        result = []
        for dtype_name, dtype in DTYPES.items():
            times = interleaved({
                "trident": training_step(ours, lambda: F.cross_entropy(ours(images).float(), labels), device, dtype),
                "timm": training_step(theirs, lambda: F.cross_entropy(theirs(images).float(), labels), device, dtype),
            }, _budget(settings))
            gain = speedup(times["trident"], times["timm"])
            result.append(Row(
                name,
                f"ViT train step {dtype_name}: {shape['image']}px/{shape['patch']}, d={shape['d']}, "
                f"{shape['layers']} layers, batch {shape['batch']}",
                milliseconds(times["trident"]), f"timm {milliseconds(times['timm'])}", f"{gain:.2f}x faster",
                ">= 1.0x (aim 1.1x)", verdict(gain >= 1.0),
                "same init shapes, learned positions, LayerNorm eps 1e-6, no dropout, fused AdamW",
            ))
        return result

    return rows


def _lm_cfg(settings: Settings) -> tuple[TransformerConfig, int, int]:
    """(config, batch, length): learned positions on both sides (nn.TransformerEncoder has none)."""
    if settings.quick:
        cfg = TransformerConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=16, pos_encoding="learned")
        return cfg, 2, 16
    cfg = TransformerConfig(d_model=256, n_heads=4, n_layers=4, d_ff=1024, max_seq_len=256, pos_encoding="learned")
    return cfg, 8, 256


def _race_with_torch(
    ours: nn.Module, theirs: nn.Module, loss: Callable[[nn.Module], Callable[[], Tensor]], settings: Settings
) -> tuple[dict[str, float], float]:
    """Training-step times of trident's model and the PyTorch reference, in turns; and the speed-up."""
    times = interleaved({
        "trident": training_step(ours, loss(ours), settings.device),
        "torch": training_step(theirs, loss(theirs), settings.device),
    }, _budget(settings))
    return times, speedup(times["trident"], times["torch"])


def lm_rows(settings: Settings) -> list[Row]:
    cfg, batch, length = _lm_cfg(settings)
    device = settings.device
    ours, theirs = CausalLM(cfg, VOCAB).to(device), TorchEncoderLM(cfg, VOCAB).to(device)
    ids = torch.randint(0, VOCAB, (batch, length + 1), device=device)
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def loss(model: nn.Module) -> Callable[[], Tensor]:
        return lambda: F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())

    times, gain = _race_with_torch(ours, theirs, loss, settings)
    return [Row(
        "lm", f"LM train step: d={cfg.d_model}, {cfg.n_layers} layers, batch {batch} x {length} tokens, vocab {VOCAB}",
        milliseconds(times["trident"]), f"nn.TransformerEncoder {milliseconds(times['torch'])}", f"{gain:.2f}x faster",
        ">= 1.2x", verdict(gain >= 1.2),
        f"pre-norm GELU, dropout {cfg.dropout}, learned positions, tied head on both; torch: causal float mask + "
        "is_causal hint; trident: SDPA is_causal (no mask)",
    )]


def _translation_batch(batch: int, length: int, device: torch.device, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Right-padded source and target ids of random lengths in [length/2, length] (pad id 0)."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(1, VOCAB, (batch, length), generator=generator)
    tgt = torch.randint(1, VOCAB, (batch, length + 1), generator=generator)
    for rows, span in ((src, length), (tgt, length + 1)):
        lengths = torch.randint(span // 2, span + 1, (batch,), generator=generator)
        rows[torch.arange(span)[None, :] >= lengths[:, None]] = 0
    return src.to(device), tgt.to(device)


def translation_rows(settings: Settings) -> list[Row]:
    if settings.quick:
        cfg, batch, length = TransformerConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=16), 2, 12
    else:
        cfg = TransformerConfig(d_model=256, n_heads=4, n_layers=3, d_ff=1024, max_seq_len=128, activation="relu",
                                norm_first=False, pos_encoding="sinusoidal")
        batch, length = 32, 48
    device = settings.device
    ours = EncoderDecoder(cfg, VOCAB, tie_embeddings="all", scale_embeddings=True).to(device)
    theirs = TorchTranslation(cfg, VOCAB).to(device)
    src, tgt = _translation_batch(batch, length, device)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]

    def loss(model: nn.Module) -> Callable[[], Tensor]:
        return lambda: F.cross_entropy(
            model(src, tgt_in).flatten(0, 1).float(), tgt_out.flatten(), ignore_index=0, label_smoothing=0.1
        )

    times, gain = _race_with_torch(ours, theirs, loss, settings)
    return [Row(
        "translation",
        f"Translation train step: d={cfg.d_model}, {cfg.n_layers}+{cfg.n_layers} layers, batch {batch}, "
        f"lengths {length // 2}-{length} (padded)",
        milliseconds(times["trident"]), f"nn.Transformer {milliseconds(times['torch'])}", f"{gain:.2f}x faster",
        ">= 1.2x", verdict(gain >= 1.2),
        f"post-norm ReLU (the paper), dropout {cfg.dropout}, shared scaled embeddings + sinusoids on both; "
        "nn.Transformer adds a final LayerNorm to each stack",
    )]


def bf16_rows(settings: Settings) -> list[Row]:
    cfg, batch, length = _lm_cfg(settings)
    device = settings.device
    model = CausalLM(cfg, VOCAB).to(device)
    ids = torch.randint(0, VOCAB, (batch, length + 1), device=device)

    def loss() -> Tensor:
        return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())

    times = interleaved({
        "bf16": training_step(model, loss, device, torch.bfloat16),
        "fp32": training_step(model, loss, device, torch.float32),
    }, _budget(settings))
    gain = speedup(times["bf16"], times["fp32"])
    return [Row(
        "bf16", f"trident LM train step, bf16 autocast vs fp32: d={cfg.d_model}, batch {batch} x {length}",
        f"bf16 {milliseconds(times['bf16'])}", f"fp32 {milliseconds(times['fp32'])}", f"bf16 {gain:.2f}x faster",
        "-", "-", "precision=bf16 (bf16-mixed); the ViT rows also compare both dtypes",
    )]
