"""``python -m megatrain.data.preprocess``: the same command as ``tools/preprocess_data.py``."""

from megatrain.data.preprocess.command import main

if __name__ == "__main__":
    main()
