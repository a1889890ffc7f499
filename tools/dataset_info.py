"""Show a dataset's documents, tokens and split sizes; dump the first training samples.

Takes the same flags as pretrain_gpt.py (and pretrain_bert.py's BERT flags), e.g.
    python tools/dataset_info.py --data-path corpus_text_document --split 969,30,1 \
        --seq-length 1024 --global-batch-size 8 --train-iters 100 --dump-samples 16 --output s.npy
BERT masked-LM samples (an .npz of Megatron's fields) with --model-family bert, a BERT flag
(--bert-no-binary-head, --mask-prob, --short-seq-prob) or a BertWordPiece --tokenizer-type.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatrain.training.dataset_info import main  # noqa: E402

if __name__ == "__main__":
    main()
