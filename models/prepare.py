"""Prepare the default models at set-up: derive the on-device model, check it, print fingerprints.

python -m models.prepare
"""

from __future__ import annotations

import sys

from models.registry import DEFAULT_CLOUD_MODEL, DEFAULT_EDGE_MODEL, DERIVED_SHA256, model_info, sha256_file


def main() -> int:
    for role, name in (("edge", DEFAULT_EDGE_MODEL), ("cloud", DEFAULT_CLOUD_MODEL)):
        info = model_info(name)
        print(
            f"{role:5s} {name:22s} {info.path}\n      model {info.fingerprint}  tokenizer {info.tokenizer_fingerprint}"
        )
    edge = model_info(DEFAULT_EDGE_MODEL)
    digest = sha256_file(edge.path)
    if digest != DERIVED_SHA256:
        print(
            f"warning: {edge.path} has sha256 {digest}, not the recorded {DERIVED_SHA256};\n"
            "         a different llama.cpp version quantizes differently (figures in docs/ assume the recorded file)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
