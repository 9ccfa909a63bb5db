import pytest
import torch

from roboscale.utils.images import fitted_size, resize_with_pad


def test_pad_keeps_the_aspect_ratio_and_centres_the_image_on_black():
    wide = torch.full((2, 3, 48, 64), 200, dtype=torch.uint8)  # a 4:3 wrist camera
    out = resize_with_pad(wide, 32)
    assert out.shape == (2, 3, 32, 32) and out.dtype == torch.uint8
    assert fitted_size(48, 64, 32) == (24, 32)
    assert torch.all(out[..., 4:28, :] == 200)  # 24 rows of content, centred
    assert torch.all(out[..., :4, :] == 0) and torch.all(out[..., 28:, :] == 0)


def test_stretch_fills_the_square_and_a_frame_already_at_size_is_returned_as_is():
    frame = torch.rand(3, 48, 64)
    assert resize_with_pad(frame, 32, mode="stretch").shape == (3, 32, 32)
    assert resize_with_pad(frame, 32, mode="stretch").min() > 0
    square = torch.rand(1, 3, 32, 32)
    assert resize_with_pad(square, 32) is square
    with pytest.raises(ValueError, match="resize mode"):
        resize_with_pad(frame, 32, mode="crop")


def test_uint8_and_float_resizing_agree_within_one_level():
    frames = torch.randint(0, 256, (4, 3, 40, 56), dtype=torch.uint8)
    as_uint8 = resize_with_pad(frames, 24).float()
    as_float = resize_with_pad(frames.float(), 24)
    assert (as_uint8 - as_float).abs().max() <= 1.0
