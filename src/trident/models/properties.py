"""What an outside family's files say of a network beyond its backbone settings, in the words of networks: the
weights room's adapters state these (trident.weights.adapters.outside_network.OutsideNetwork.properties), and the
task that holds such a network maps each onto its own setting or its data's (``TridentTask.FROM_NETWORK``), as a
checkpoint of that task states its settings itself. A task that has no setting for a property ignores it.

The geometry of a network's tables and kernels keeps the network's own word (``max_seq_len``, ``image_size``,
``patch_size``: TransformerConfig's and VisionTransformer's), as Hugging Face's configs call them too.
"""

from __future__ import annotations

TIED_HEAD = "tied_head"  # bool: the output layer is the token embedding's matrix
SCALED_EMBEDDING = "scaled_embedding"  # bool: token embeddings are multiplied by sqrt(d_model)
MAX_SEQ_LEN = "max_seq_len"  # int: the positions it was built (a bounded table) or trained (rope) for
READOUT = "readout"  # str: what its classifier reads, as VisionTransformer's pool says it ("cls": the class token)
IMAGE_SIZE = "image_size"  # int: the image side its position grid was built for (grid side x patch side)
PATCH_SIZE = "patch_size"  # int: the side of its patch embedding's kernel
CHANNELS = "channels"  # int: the image channels its patch embedding reads
PIXEL_MEAN = "pixel_mean"  # list[float]: per channel, the pixel statistics the network was trained with
PIXEL_STD = "pixel_std"
CLASSES = "classes"  # int: the rows of its classification head, where it has one
POOLER = "pooler"  # bool | str: a dense layer and tanh (true) or GELU ("gelu") read the pooled vector before the classes
# A two-tower network (CLIP): its backbone (OutsideNetwork.model) is the text tower.
PROJECTION_DIM = "projection_dim"  # int: the width both towers project their pooled features to
# dict | None: a tower's TransformerConfig fields that differ from the backbone's (None: it is the backbone).
TEXT_TOWER = "text_tower"
IMAGE_TOWER = "image_tower"
END_OF_TEXT = "end_of_text"  # int | None: the token id whose position the text is pooled at (None: each row's largest)
# An encoder-decoder (EncoderDecoder): which of its token embeddings and output layer are one matrix (seq2seq.TIE_MODES),
# a fixed vector added to its logits (BART's final_logits_bias), the token id its decoder's input starts with before BOS,
# which decoding then forces first (BART's </s>: the input is </s> <s> tokens), whether its decoder's output is scaled
# by d_model**-0.5 before the output layer (T5 v1.0), and the token its decoder starts from in place of BOS (T5's <pad>).
SHARED_EMBEDDINGS = "shared_embeddings"  # str: all | decoder | embeddings | none
LOGITS_BIAS = "logits_bias"  # bool
START_BEFORE_BOS = "start_before_bos"  # int | None
SOURCE_BOS = "source_bos"  # bool: its encoder reads `<s> tokens </s>` (BART's), not `tokens </s>`
RESCALED_HEAD = "rescaled_head"  # bool
DECODER_START = "decoder_start"  # str: the token's text
