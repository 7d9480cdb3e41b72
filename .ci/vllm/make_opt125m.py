"""Write an offline stand-in for `facebook/opt-125m` into a Hugging Face cache (HF_HOME).

vLLM's scheduler tests build `ModelConfig(model="facebook/opt-125m")`, which reads the model's
config and tokenizer; CI has no network. The config is transformers' `OPTConfig()` defaults,
which are opt-125m's published config; the tokenizer is synthetic (a word-level vocabulary of
the published size, 50,265 entries, with the same special tokens and ids: <s>=0, <pad>=1,
</s>=2, <unk>=3). No weights: the tests never load a model.

Usage: python make_opt125m.py HF_HOME
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import OPTConfig, PreTrainedTokenizerFast

REPO = "facebook/opt-125m"
REVISION = "0" * 40  # a fixed fake commit; refs/main points at it
NUM_VOCAB_ENTRIES = 50265  # the published tokenizer's vocabulary (the config pads to 50272)
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    repo_dir = Path(sys.argv[1]) / "hub" / ("models--" + REPO.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(REVISION)

    config = OPTConfig(architectures=["OPTForCausalLM"], prefix="</s>")
    config_dict = config.to_dict()
    config_dict["_name_or_path"] = REPO
    config_dict["torch_dtype"] = "float16"
    (snapshot / "config.json").write_text(json.dumps(config_dict, indent=2))

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for index in range(len(SPECIAL_TOKENS), NUM_VOCAB_ENTRIES):
        vocab[f"t{index}"] = index
    model = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    model.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model,
        bos_token="</s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=config.max_position_embeddings,
    )
    tokenizer.save_pretrained(snapshot)
    print(snapshot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
