"""Pre-train the toy family with pretrain_gpt.py's flags (``torchrun tests/toy_family/pretrain_toy.py ...``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatrain.errors import user_errors_exit  # noqa: E402
from megatrain.training.arguments import parse_args  # noqa: E402
from megatrain.training.trainer import pretrain  # noqa: E402
from tests.toy_family import TOY  # noqa: E402  (registers the family)


@user_errors_exit
def main() -> None:
    pretrain(parse_args(sys.argv[1:]), family=TOY.name)


if __name__ == "__main__":
    main()
