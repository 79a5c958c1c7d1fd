"""Can profile-model refuse another model at ``--out`` before the load? Its weights fingerprint
(``artifacts.fingerprint``) from the checkpoint's safetensors files, read tensor by tensor with no
model built, against the load (``common.models.load_model``) and the fingerprint of the loaded
model, side by side in one process (issue 30).

    python benchmarks/checkpoint_fingerprint.py [MODEL_DIR] [--repeats 3]

Prints, per repeat, the seconds of: the checkpoint's fingerprint (first: cold page cache on the first
repeat when the files are not cached), the load alone, the fingerprint of the loaded model, the load
and its fingerprint (what the job pays before it can compare); then whether the two fingerprints
are equal (the files' tensors alone, and with ``lm_head.weight`` tied to the embedding as the config
says) and which tensor names differ.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path


def checkpoint_tensors(directory: Path, tie: bool):
    """``(name, tensor)`` of every tensor in the directory's ``*.safetensors`` files, one at a time;
    ``tie``: also ``lm_head.weight`` as ``model.embed_tokens.weight`` when the files lack it (a
    config with ``tie_word_embeddings``: the loaded model's state dict holds both names)."""
    from safetensors import safe_open

    seen = set()
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as opened:
            for name in opened.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                seen.add(name)
                tensor = opened.get_tensor(name)
                yield name, tensor
                if tie and name == "model.embed_tokens.weight":
                    embedding = tensor
    if tie and "lm_head.weight" not in seen:
        yield "lm_head.weight", embedding


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="a local model directory (default: the embedded)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    from artifacts.fingerprint import tensors_fingerprints, weights_fingerprint
    from common.models import load_model, resolve_model

    torch.set_num_threads(1)
    directory = Path(resolve_model(args.model))
    import json

    tie = bool(json.loads((directory / "config.json").read_text()).get("tie_word_embeddings"))
    rows = []
    for _ in range(args.repeats):
        # the checkpoint first: its first read is from a cold page cache when the model's files are
        begun = time.perf_counter()
        names: list[str] = []

        def tensors(names=names):
            for name, tensor in checkpoint_tensors(directory, tie=False):
                names.append(name)
                yield name, tensor

        untied = tensors_fingerprints(tensors(), ("float32",))["float32"]
        ended = time.perf_counter()
        from_checkpoint = tensors_fingerprints(checkpoint_tensors(directory, tie=tie), ("float32",))["float32"]
        started = time.perf_counter()
        model = load_model(str(directory))
        loaded = time.perf_counter()
        from_model = weights_fingerprint(model)
        fingerprinted = time.perf_counter()
        model_names = set(model.state_dict())
        del model
        gc.collect()
        rows.append((loaded - started, fingerprinted - loaded, fingerprinted - started, ended - begun))
    for load, finger, both, checkpoint in rows:
        print(
            f"load {load:.2f} s, its fingerprint {finger:.2f} s, together {both:.2f} s; checkpoint {checkpoint:.2f} s"
        )
    median = [statistics.median(column) for column in zip(*rows, strict=True)]
    print(
        f"median: load {median[0]:.2f} s + fingerprint {median[1]:.2f} s = {median[2]:.2f} s; "
        f"checkpoint {median[3]:.2f} s ({median[3] / median[2]:.2f}x the load and its fingerprint)"
    )
    print(
        f"equal: the files' tensors alone {from_model == untied}; "
        f"with lm_head tied ({tie}) {from_model == from_checkpoint}"
    )
    only_model, only_file = sorted(model_names - set(names)), sorted(set(names) - model_names)
    print(f"names only in the loaded model: {only_model}; only in the checkpoint: {only_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
