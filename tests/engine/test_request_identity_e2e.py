"""Keys name exactly the KV, in a real vLLM (CPU backend) with kvtier: issue 11 item 1.

Requests whose token ids are equal while their KV differs never get each other's KV:
  - prompt embeddings (every token id is 0): two prompts of the same length with different
    embeddings share nothing; embeddings that differ in one value share the chunks before it;
    mixed prompts (token ids, then embeddings) share the chunks before the embeddings; the
    same embeddings again hit (kvtier keys them by content, as vLLM's block hash does);
  - images (the same `<image>` placeholder tokens): the same text with another image shares
    only the chunk of text before the image; the same image again hits; two images swapped;
  - LoRA adapters: two adapters never share; one adapter's files at another path, under
    another name, do (kvtier keys an adapter by its content); an adapter rewritten in place
    under its id is not cached (its engine keeps the weights it loaded), and a new id of the
    new files gets their own KV, never the old weights'.
Every hit gives the miss path's tokens (kvtier bypassed: `skip_load`/`skip_store`). Controls
inject the bug (keys from token ids only) and show that these checks catch it: a cross hit
and another output.

Three engines, one at a time (class-scoped), their engine cores in this process so that the
controls can patch kvtier's request table: the "test" model with prompt embeds on, a generated
Idefics3-style vision-language model (tiny_vlm.py), and the "test" model with LoRA on. Chunks
of 64 tokens; vLLM's own prefix cache is reset before each request, so every hit is kvtier's.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tiny_vlm import IMAGE_TOKENS, image, make_tiny_idefics3, words
from vllm_harness import (
    greedy,
    kvtier_counter,
    kvtier_transfer_config,
    metric,
    random_prompts,
    start_engine,
)

pytestmark = pytest.mark.vllm

CHUNK = 64
BYPASS = {"skip_load": True, "skip_store": True}
HIDDEN_SIZE = 128  # the "test" preset's width: one prompt embedding per token


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one request got: its output tokens and how much kvtier (and vLLM) loaded."""

    # Prompt length in tokens (image placeholders included) and the greedy output.
    prompt_tokens: int
    tokens: list[int]
    # This request's kvtier lookup_hit_tokens and loaded_tokens.
    hit_tokens: float
    loaded_tokens: float
    # vLLM's vllm:external_prefix_cache_hits (tokens a connector provided).
    external_hits: float
    # kvtier's uncacheable_requests.
    uncacheable: float


def run(llm: Any, prompt: dict[str, Any], params: dict[str, Any] | None = None,
        lora: Any = None) -> Outcome:
    """Run one prompt (under LoRA adapter `lora`) after emptying vLLM's own prefix cache;
    counters are this run's."""
    llm.reset_prefix_cache()
    before = (kvtier_counter("lookup_hit_tokens"), kvtier_counter("loaded_tokens"),
              metric(llm, "vllm:external_prefix_cache_hits"),
              kvtier_counter("uncacheable_requests"))
    [output] = llm.generate([prompt], greedy(16, params), use_tqdm=False, lora_request=lora)
    after = (kvtier_counter("lookup_hit_tokens"), kvtier_counter("loaded_tokens"),
             metric(llm, "vllm:external_prefix_cache_hits"),
             kvtier_counter("uncacheable_requests"))
    return Outcome(len(output.prompt_token_ids), list(output.outputs[0].token_ids),
                   *(a - b for a, b in zip(after, before, strict=True)))


@contextlib.contextmanager
def in_process_engine(model_dir: Path, **overrides: Any) -> Iterator[Any]:
    """An engine with kvtier (memory tier) whose engine core runs in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that a control can inject a bug into kvtier's
    scheduler; it also starts in a third of the time."""
    config = kvtier_transfer_config([{"kind": "memory", "capacity": "8MiB"}], CHUNK)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with start_engine(model_dir, config, **overrides) as engine:
            yield engine


def inject_keys_without_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug of issue 11: chunk keys from token ids only (no images, no embeddings)."""
    import kvtier.integrations.vllm.scheduler.requeststate as requeststate

    monkeypatch.setattr(requeststate, "needs_chunk_extras", lambda request: False)


def loadable(num_tokens: int) -> int:
    """Tokens of a prompt kvtier can load: its full chunks before the last token."""
    return (num_tokens - 1) // CHUNK * CHUNK


# -- prompt embeddings --------------------------------------------------------------------------

def embeds(seed: int, num_tokens: int = 200) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, HIDDEN_SIZE, generator=gen).to(torch.bfloat16)


class TestPromptEmbeds:
    @pytest.fixture(scope="class")
    def llm(self, tiny_model_dir: Path) -> Iterator[Any]:
        with in_process_engine(tiny_model_dir, enable_prompt_embeds=True) as engine:
            yield engine

    def test_different_embeddings_of_one_length_never_share_kv(self, llm: Any) -> None:
        """200 embeddings (3 loadable chunks), all token ids 0: b after a loads nothing;
        each again loads all 192 tokens; every output is its miss path's."""
        a, b = {"prompt_embeds": embeds(1)}, {"prompt_embeds": embeds(2)}
        miss_a, miss_b = run(llm, a, BYPASS).tokens, run(llm, b, BYPASS).tokens
        assert miss_a != miss_b  # control: another request's KV would change the output

        first_a = run(llm, a)
        assert first_a.tokens == miss_a and first_a.hit_tokens == 0
        first_b = run(llm, b)
        assert first_b.tokens == miss_b
        assert (first_b.hit_tokens, first_b.loaded_tokens, first_b.external_hits) == (0, 0, 0)
        for prompt, miss in ((a, miss_a), (b, miss_b)):
            again = run(llm, prompt)
            assert again.tokens == miss
            assert again.hit_tokens == again.loaded_tokens == again.external_hits == 192
        # Keyed by content, not refused: no request counted uncacheable.
        assert first_a.uncacheable == first_b.uncacheable == again.uncacheable == 0

    def test_embeddings_that_differ_in_one_value_share_only_the_chunks_before_it(
            self, llm: Any) -> None:
        """One value changed at token 100 (chunk 1): chunk 0 loads, nothing after it."""
        base = embeds(3)
        changed = base.clone()
        changed[100, 7] += 1
        run(llm, {"prompt_embeds": base})
        miss = run(llm, {"prompt_embeds": changed}, BYPASS).tokens
        hit = run(llm, {"prompt_embeds": changed})
        assert (hit.hit_tokens, hit.loaded_tokens, hit.external_hits) == (CHUNK, CHUNK, CHUNK)
        assert hit.tokens == miss

    def test_mixed_prompts_with_the_same_tokens_share_only_the_chunks_before_the_embeddings(
            self, llm: Any) -> None:
        """100 token ids, then 100 embeddings (vLLM's mixed mode: `prompt_is_token_ids`):
        another prompt's embeddings after the same tokens share chunk 0 only."""
        first, second = mixed_prompt(4), mixed_prompt(5)
        miss = run(llm, second, BYPASS).tokens
        run(llm, first)
        hit = run(llm, second)
        assert (hit.hit_tokens, hit.loaded_tokens, hit.external_hits) == (CHUNK, CHUNK, CHUNK)
        assert hit.tokens == miss
        again = run(llm, first)
        assert again.hit_tokens == again.loaded_tokens == 192

    def test_control_keys_without_the_embeddings_serve_the_other_requests_kv(
            self, llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        """The bug of issue 11 injected: all-0 token ids, one key chain for any embeddings."""
        inject_keys_without_extras(monkeypatch)
        a, b = {"prompt_embeds": embeds(6)}, {"prompt_embeds": embeds(7)}
        miss_b = run(llm, b, BYPASS).tokens
        run(llm, a)
        b_after_a = run(llm, b)
        assert b_after_a.hit_tokens == 192
        assert b_after_a.tokens != miss_b


def mixed_prompt(seed: int) -> dict[str, Any]:
    """Token ids 10..109, then 100 embeddings of `seed` (zeros where token ids are used)."""
    import torch

    rows = torch.zeros(200, HIDDEN_SIZE)
    rows[100:] = torch.randn(100, HIDDEN_SIZE, generator=torch.Generator().manual_seed(seed))
    return {"prompt_embeds": rows.to(torch.bfloat16),
            "prompt_token_ids": list(range(10, 110)) + [0] * 100,
            "prompt_is_token_ids": [True] * 100 + [False] * 100}


# -- images ---------------------------------------------------------------------------------------

TEXT_BEFORE, TEXT_AFTER = 70, 80  # words around the image: chunk 0 is text only
IMAGE_SPAN = IMAGE_TOKENS + 3  # <fake_token_around_image><global-img> <image>*64 <fake...>


def image_prompt(*image_seeds: int) -> dict[str, Any]:
    """The same text for any images: 70 words, the images' placeholders, 80 words."""
    text = words(7, TEXT_BEFORE) + " <image>" * len(image_seeds) + " " + words(8, TEXT_AFTER)
    images = [image(seed) for seed in image_seeds]
    return {"prompt": text, "multi_modal_data": {"image": images[0] if len(images) == 1
                                                 else images}}


class TestImages:
    @pytest.fixture(scope="class")
    def vlm(self, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
        model_dir = make_tiny_idefics3(tmp_path_factory.mktemp("vlm"))
        with in_process_engine(model_dir, limit_mm_per_prompt={"image": 2}) as engine:
            yield engine

    def test_the_same_text_with_another_image_shares_only_the_text_before_it(
            self, vlm: Any) -> None:
        cat, dog = image_prompt(1), image_prompt(2)
        miss_cat, miss_dog = run(vlm, cat, BYPASS), run(vlm, dog, BYPASS)
        assert miss_cat.tokens != miss_dog.tokens  # control: the image decides the output
        num_tokens = miss_cat.prompt_tokens
        assert num_tokens == TEXT_BEFORE + IMAGE_SPAN + TEXT_AFTER

        assert run(vlm, cat).tokens == miss_cat.tokens
        dog_after_cat = run(vlm, dog)
        assert dog_after_cat.tokens == miss_dog.tokens
        assert (dog_after_cat.hit_tokens, dog_after_cat.loaded_tokens,
                dog_after_cat.external_hits) == (CHUNK, CHUNK, CHUNK)
        cat_again = run(vlm, cat)
        assert cat_again.tokens == miss_cat.tokens
        assert cat_again.hit_tokens == cat_again.loaded_tokens == loadable(num_tokens)
        assert cat_again.uncacheable == 0

    def test_two_images_swapped_share_only_the_text_before_them(self, vlm: Any) -> None:
        """Equal token ids, the same two images, in the other order."""
        first, swapped = image_prompt(3, 4), image_prompt(4, 3)
        miss = run(vlm, swapped, BYPASS).tokens
        run(vlm, first)
        hit = run(vlm, swapped)
        assert (hit.hit_tokens, hit.loaded_tokens) == (CHUNK, CHUNK)
        assert hit.tokens == miss

    def test_control_keys_without_the_images_serve_the_other_images_kv(
            self, vlm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        """The bug of issue 11 injected (chunk keys from token ids only): the checks above
        fail, a cross hit of every loadable chunk and another output than the miss path's."""
        inject_keys_without_extras(monkeypatch)
        cat, dog = image_prompt(5), image_prompt(6)
        miss_dog = run(vlm, dog, BYPASS).tokens
        run(vlm, cat)
        dog_after_cat = run(vlm, dog)
        assert dog_after_cat.hit_tokens == 192
        assert dog_after_cat.tokens != miss_dog


# -- LoRA adapters ------------------------------------------------------------------------------

def write_adapter(directory: Path, seed: int, rank: int = 8) -> str:
    """A PEFT-style LoRA adapter of the "test" preset's attention (q, k, v), from `seed`,
    strong enough that its outputs differ from the base model's and from other seeds'."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory.parent / "model")
    width = config.hidden_size
    kv_width = config.num_key_value_heads * (width // config.num_attention_heads)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj, out in (("q_proj", width), ("k_proj", kv_width), ("v_proj", kv_width)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, width, generator=gen) / 2
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=gen) / 2
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()},
              str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "bias": "none",
        "target_modules": ["q_proj", "k_proj", "v_proj"], "task_type": "CAUSAL_LM"}))
    return str(directory)


class TestLoraAdapters:
    @pytest.fixture(scope="class")
    def lora_llm(self, tmp_path_factory: pytest.TempPathFactory,
                 tiny_model_dir: Path) -> Iterator[tuple[Any, Path]]:
        root = tmp_path_factory.mktemp("lora")
        (root / "model").symlink_to(tiny_model_dir)
        with in_process_engine(tiny_model_dir, enable_lora=True, max_lora_rank=8,
                               max_loras=2) as engine:
            yield engine, root

    def test_two_adapters_never_share_and_one_adapter_at_two_paths_does(
            self, lora_llm: tuple[Any, Path]) -> None:
        from vllm.lora.request import LoRARequest

        llm, root = lora_llm
        [prompt] = random_prompts([300], seed=41)
        a = LoRARequest("a", 1, write_adapter(root / "a", seed=1))
        b = LoRARequest("b", 2, write_adapter(root / "b", seed=2))
        misses = [run(llm, prompt, BYPASS, lora).tokens for lora in (a, b, None)]
        assert len({tuple(tokens) for tokens in misses}) == 3  # each adapter decides
        run(llm, prompt, lora=a)
        for lora, miss in ((b, misses[1]), (None, misses[2])):
            other = run(llm, prompt, lora=lora)
            assert (other.loaded_tokens, other.tokens) == (0, miss)
        shutil.copytree(a.lora_path, root / "a-elsewhere")
        copy = run(llm, prompt, lora=LoRARequest("a-copy", 3, str(root / "a-elsewhere")))
        assert copy.loaded_tokens == copy.external_hits == loadable(300)
        assert copy.tokens == misses[0]

    def test_an_adapter_rewritten_under_its_id_is_not_cached_and_never_served_to_a_new_id(
            self, lora_llm: tuple[Any, Path]) -> None:
        """Found by trying: vLLM kept id 10's old weights after its files were rewritten,
        kvtier stored that KV under the new files' fingerprint, and id 11, which loaded the
        new files, was served it."""
        from vllm.lora.request import LoRARequest

        llm, root = lora_llm
        [prompt] = random_prompts([300], seed=42)
        path = write_adapter(root / "policy", seed=3)
        old = LoRARequest("policy", 10, path)
        run(llm, prompt, BYPASS, old)  # its engine loads the weights of seed 3
        write_adapter(root / "policy", seed=4)  # a trainer writes new ones over them
        stale = run(llm, prompt, lora=old)
        assert (stale.loaded_tokens, stale.uncacheable) == (0, 1)
        new = LoRARequest("policy-v2", 11, path)
        miss = run(llm, prompt, BYPASS, new)
        assert miss.tokens != stale.tokens  # control: the old weights answer otherwise
        hit = run(llm, prompt, lora=new)
        assert (hit.loaded_tokens, hit.tokens) == (0, miss.tokens)  # not the old KV
        again = run(llm, prompt, lora=new)
        assert (again.loaded_tokens, again.tokens) == (loadable(300), miss.tokens)
