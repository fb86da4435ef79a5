"""verify=True's second batch (graphopt/verification/second_batch.py): the example's shapes and dtypes, values
drawn apart from it within the ranges it shows."""
import torch

from graphopt.verification.second_batch import second_batch


def test_each_tensor_is_drawn_apart_within_the_examples_ranges():
    ids = torch.randint(5, 50, (4, 32))
    labels = torch.randint(0, 50, (4, 32)).masked_fill(torch.rand(4, 32) < 0.5, -100)
    mask, images = torch.ones(4, 32, dtype=torch.long), torch.randn(4, 3, 8, 8) * 2 + 1
    keep = torch.rand(4, 32) < 0.25
    (got_ids, got_images), kw = second_batch((ids, images), {"labels": labels, "mask": mask, "keep": keep,
                                                             "same": ids, "scale": 0.5})
    assert got_ids.shape == ids.shape and got_ids.dtype == ids.dtype and not torch.equal(got_ids, ids)
    assert int(got_ids.min()) >= 5 and int(got_ids.max()) <= 49          # the vocabulary the example shows
    assert not torch.equal(kw["same"], got_ids)                           # one tensor given twice: two draws
    ignored = (kw["labels"] == -100).float().mean()
    assert 0.3 < ignored < 0.7 and int(kw["labels"][kw["labels"] >= 0].min()) >= 0  # -100 where it may be
    assert torch.equal(kw["mask"], mask)                                 # an all-ones mask stays all ones
    assert kw["keep"].dtype == torch.bool and 0.1 < kw["keep"].float().mean() < 0.45
    assert abs(float(got_images.mean()) - 1) < 0.3 and abs(float(got_images.std()) - 2) < 0.3
    assert kw["scale"] == 0.5                                             # values other than tensors stay


def test_the_draw_is_the_same_for_the_same_seed():
    x = torch.randn(3, 4)
    assert torch.equal(second_batch((x,), {})[0][0], second_batch((x,), {})[0][0])
    assert not torch.equal(second_batch((x,), {}, seed=1)[0][0], second_batch((x,), {}, seed=2)[0][0])
