"""An image seen before is not decoded or resized again: the fetcher's memo maps its bytes (under the same
processing parameters) to what they became, and `decode_again` remakes exactly the same patches when the
embedding cache no longer holds them."""

from __future__ import annotations

import numpy as np

from common.config import FetcherConfig
from common.protocol import MediaInput
from tests.media import data_url, make_image
from workers.fetcher.image import ImageProcessorSpec
from workers.fetcher.media import DecodedMemo, MemoEntry, load_image

RULES = FetcherConfig()
SPEC = ImageProcessorSpec()


def image_item(seed: int, **limits: int) -> MediaInput:
    return MediaInput("image", data_url(make_image(96, 80, seed=seed)), **limits)


def test_a_remembered_image_skips_patchifying_and_decodes_again_to_the_same_patches() -> None:
    memo = DecodedMemo(8)
    first = load_image(image_item(1), SPEC, RULES, "model", memo)
    again = load_image(image_item(1), SPEC, RULES, "model", memo)
    assert first.pixel_values is not None and first.decode_again is None
    assert again.pixel_values is None and again.decode_again is not None
    assert (again.content_hash, again.grid_thw, again.num_tokens) == (
        first.content_hash,
        first.grid_thw,
        first.num_tokens,
    )
    assert again.normalization == first.normalization
    remade = again.decode_again()
    assert remade.content_hash == first.content_hash and remade.grid_thw == first.grid_thw
    np.testing.assert_array_equal(remade.pixel_values, first.pixel_values)


def test_other_bytes_other_limits_or_another_model_are_not_remembered() -> None:
    memo = DecodedMemo(8)
    first = load_image(image_item(1), SPEC, RULES, "model", memo)
    assert load_image(image_item(2), SPEC, RULES, "model", memo).pixel_values is not None  # other bytes
    smaller = load_image(image_item(1, max_pixels=28 * 28 * 4), SPEC, RULES, "model", memo)  # other processing
    assert smaller.pixel_values is not None and smaller.content_hash != first.content_hash
    assert load_image(image_item(1), SPEC, RULES, "other model", memo).pixel_values is not None


def test_without_a_memo_every_load_patchifies() -> None:
    assert load_image(image_item(1), SPEC, RULES, "model").pixel_values is not None
    assert load_image(image_item(1), SPEC, RULES, "model").pixel_values is not None


def test_the_memo_forgets_the_least_recently_used_entry() -> None:
    memo = DecodedMemo(2)
    entry = MemoEntry("h", (1, 2, 2), 1, None)
    memo.put("a", entry)
    memo.put("b", entry)
    assert memo.get("a") is entry  # a is now the most recently used
    memo.put("c", entry)
    assert memo.get("b") is None and memo.get("a") is entry and memo.get("c") is entry
