"""ELECTRA's generator (Clark et al. 2020, section 3.2): a masked LM narrower than the discriminator, sharing its
token embedding (the generator's tied output layer with it), its learned position table and its embedding norm."""

from __future__ import annotations

import dataclasses

from trident.backbone import TransformerConfig
from trident.errors import ConfigError, is_number
from trident.models.masked_lm import MaskedLM
from trident.models.replaced_token_detector import ReplacedTokenDetector


def generator_config(discriminator: TransformerConfig, size: float) -> TransformerConfig:
    """The generator's stack: the discriminator's with its width, feed-forward width and head count scaled by ``size``
    (task.generator_size, (0, 1]; the paper's best is 1/4 to 1/2), heads of the discriminator's head size (ELECTRA's
    ``hidden_size // 64`` heads), as many layers, and the discriminator's embedding width E, projected to its own
    width where they differ (transformers' ``embeddings_project``)."""
    check_generator_size(size)
    width = max(1, round(discriminator.d_model * size))
    heads = max(1, width // discriminator.head_dim)
    if width % heads:
        raise ConfigError(f"task.generator_size={size:g} gives the generator a width of {width}, which {heads} heads "
                          f"of the discriminator's size {discriminator.head_dim} do not split: choose a size whose "
                          f"width is a multiple of {discriminator.head_dim}")
    embedding = discriminator.embedding_width
    return dataclasses.replace(
        discriminator, d_model=width, n_heads=heads, n_kv_heads=None, head_dim=None,
        d_ff=max(1, round(discriminator.d_ff * size)), embedding_dim=None if embedding == width else embedding,
        # Declared ELECTRA's where the discriminator declares no family: the hf export writes the two as one family
        # (a MaskedLM of no family would be written as BERT's or ALBERT's).
        family=discriminator.family or "electra",
    )


def check_generator_size(size: object) -> None:
    if not is_number(size) or not 0.0 < size <= 1.0:  # type: ignore[operator]
        raise ConfigError(f"task.generator_size must be in (0, 1] (the generator's width over the discriminator's), got "
                          f"{size!r}: a generator wider than the discriminator is refused (the paper's best are 1/4 to "
                          "1/2 of its width: wider ones learn too well for the discriminator to learn from them); set "
                          "e.g. task.generator_size=0.25")


def share_embeddings(generator: MaskedLM, discriminator: ReplacedTokenDetector) -> None:
    """Give ``generator`` the discriminator's token embedding (and tie its output layer to it), learned position table
    and embedding norm: the same modules, trained by both losses (ELECTRA's ``electra/embeddings`` scope)."""
    generator.embed = discriminator.embed
    generator.head.weight = discriminator.embed.weight
    if discriminator.cfg.pos_encoding == "learned":  # a table of width E; the others have no weights to share
        generator.encoder.pos_encoding = discriminator.encoder.pos_encoding
    generator.encoder.embedding_norm = discriminator.encoder.embedding_norm
