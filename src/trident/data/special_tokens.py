"""The special tokens and ids that data, tasks and exports share, each defined here once. It imports nothing, so
a command reads them (``trident.commands.fill_mask``'s ``[MASK]``) before torch is imported."""

# The target of a position the loss does not count (a chat prompt token's successor, padding, an MLM position
# not selected for prediction): F.cross_entropy's default ignore_index.
IGNORE_INDEX = -100

# BERT's vocabulary: trident's MLM appends MASK_TOKEN and PAD_TOKEN; a WordPiece directory names the others.
UNK_TOKEN = "[UNK]"
CLS_TOKEN = "[CLS]"
SEP_TOKEN = "[SEP]"
MASK_TOKEN = "[MASK]"
PAD_TOKEN = "[PAD]"

# RoBERTa's, T5's and trident's translation tokenizer's: padding, start and end of a sequence.
SEQ_PAD_TOKEN = "<pad>"
SEQ_START_TOKEN = "<s>"
SEQ_END_TOKEN = "</s>"
SEQ_MASK_TOKEN = "<mask>"  # RoBERTa's mask
