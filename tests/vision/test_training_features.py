"""Training features of the image task after torchvision's classification reference: v2 augmentation presets
(vision/transforms.py, vision/datasets.py), MixUp/CutMix soft targets, the EMA of the weights
(core/loop/ema.py), weight-decay groups (core.optim.param_groups), top-5 accuracy and channels-last."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import default_collate

from core import checkpoint
from core.data.samplers import RepeatedAugmentationBatchSampler, ShuffledBatchSampler
from core.data.seeded import SeededBatches, SeededCollate, SeededSamples
from core.loop.ema import EMA
from core.loop.trainer import Trainer, TrainerConfig
from core.optim import OptimConfig, build_optimizer
from core.rng import derive_seed
from tests.core.accumulation_reference import (
    accumulated_grads,
    max_deviation,
    mean_of_means_grads,
    one_batch_grads,
)
from tests.helpers import read_metrics
from vision.classification import ImageClassification
from vision.datasets import digits, imagefolder
from vision.models import ViT
from vision.transforms import AUTO_AUGMENT, Augment, MixCollate

# ---- augmentation presets -------------------------------------------------------------------------------


def _halves(root: Path, size: tuple[int, int] = (16, 16)) -> Path:
    """root/{train,val}/{a,b}/x.png: left half red, right half blue (a left-right asymmetric image)."""
    w, h = size
    img = Image.new("RGB", size, (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, w // 2, h))
    for split in ("train", "val"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            img.save(root / split / c / "x.png")
    return root


def test_whole_image_crop_then_flip_probability(tmp_path: Path) -> None:
    root = str(_halves(tmp_path))
    whole = {"image_size": 8, "crop_scale": (1.0, 1.0), "crop_ratio": (1.0, 1.0)}
    never = imagefolder(root=root, **whole, augmentation=Augment(hflip_prob=0.0))
    always = imagefolder(root=root, **whole, augmentation=Augment(hflip_prob=1.0))
    val = never.val[0][0]
    assert val.shape == (3, 8, 8) and val[0, :, 0].min() == 1 and val[2, :, -1].min() == 1  # red | blue
    torch.manual_seed(0)
    assert torch.equal(never.train[0][0], val)  # the crop covers the whole image, resized as in validation
    assert torch.equal(always.train[0][0], val.flip(-1))


def test_validation_resizes_the_shorter_side_then_crops_the_centre(tmp_path: Path) -> None:
    # 30x10: blue, red, blue thirds; a squash to a square would keep the blue thirds, a centre crop drops them
    img = Image.new("RGB", (30, 10), (0, 0, 255))
    img.paste((255, 0, 0), (10, 0, 20, 10))
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
        img.save(tmp_path / split / "a" / "x.png")
    x = imagefolder(root=str(tmp_path), image_size=8).val[0][0]
    assert x.shape == (3, 8, 8)
    assert (x[0] > x[2]).all()  # red everywhere: the centre, not the squashed whole
    wide = imagefolder(root=str(tmp_path), image_size=8, val_resize=16).val[0][0]
    assert wide.shape == (3, 8, 8) and (wide[0] > wide[2]).all()


def test_crop_scale_bounds_the_crop_area(tmp_path: Path) -> None:
    # a small crop_scale zooms in: a 16x16 crop of a red|blue image often sees one colour only
    root = str(_halves(tmp_path, (64, 64)))
    d = imagefolder(root=root, image_size=16, crop_scale=(0.02, 0.05), augmentation=Augment(hflip_prob=0))
    torch.manual_seed(0)
    one_colour = sum(bool((x[0] > 0).all() or (x[2] > 0).all()) for x in (d.train[0][0] for _ in range(20)))
    assert one_colour >= 10
    full = imagefolder(root=root, image_size=16, crop_scale=(1.0, 1.0), augmentation=Augment(hflip_prob=0))
    assert not any((x[0] > 0).all() for x in (full.train[0][0] for _ in range(5)))


@pytest.mark.parametrize("policy", [p for p in AUTO_AUGMENT if p != "none"])
def test_auto_augment_policies_change_images_and_keep_their_range(tmp_path: Path, policy: str) -> None:
    # run on uint8 (ImageFolder) and on float [0, 1] (digits) images, before normalisation: [-1, 1] after
    folder = imagefolder(root=str(_halves(tmp_path)), image_size=8, augmentation=Augment(auto_augment=policy))
    plain = imagefolder(root=str(tmp_path), image_size=8, augmentation=Augment())
    small = digits(augmentation=Augment(hflip_prob=0, auto_augment=policy))
    torch.manual_seed(0)
    for ds, base in ((folder.train, plain.train), (small.train, digits().train)):
        changed = 0
        for seed in range(8):
            torch.manual_seed(seed)
            x = ds[0][0]
            torch.manual_seed(seed)
            changed += not torch.equal(x, base[0][0])
            assert x.dtype == torch.float32 and x.min() >= -1 and x.max() <= 1
        assert changed >= 4, policy


def test_random_erase_zeroes_a_rectangle_after_normalisation(tmp_path: Path) -> None:
    d = imagefolder(root=str(_halves(tmp_path)), image_size=16, augmentation=Augment(random_erase=1.0))
    torch.manual_seed(0)
    x = d.train[0][0]
    zeros = (x == 0).all(0).nonzero()  # red and blue pixels are +-1 in every channel once normalised
    assert len(zeros) > 0  # erased to 0: the normalised mean
    rows, cols = zeros[:, 0], zeros[:, 1]
    box = x[:, rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    assert (box == 0).all()  # one filled rectangle


def test_digits_keep_their_pipeline_unless_a_key_is_set() -> None:
    d, flipped = digits(), digits(augmentation=Augment(hflip_prob=1.0))
    torch.manual_seed(0)
    x = d.train[0][0]
    torch.manual_seed(0)
    assert torch.equal(flipped.train[0][0], x.flip(-1))
    assert len(d.train.transform.transforms) == 3  # the +-1 px shift, ToDtype, Normalize


def test_nearest_interpolation_keeps_source_values(tmp_path: Path) -> None:
    img = Image.new("RGB", (5, 5), (0, 0, 0))
    img.paste((255, 255, 255), (0, 0, 2, 5))
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
        img.save(tmp_path / split / "a" / "x.png")
    near = imagefolder(root=str(tmp_path), image_size=16, augmentation=Augment(interpolation="nearest"))
    bilinear = imagefolder(root=str(tmp_path), image_size=16)
    assert set(near.val[0][0].unique().tolist()) == {-1.0, 1.0}
    assert len(bilinear.val[0][0].unique()) > 2


# ---- MixUp / CutMix -------------------------------------------------------------------------------------


def _task(**kw: object) -> ImageClassification:
    return ImageClassification(model={"name": "small_cnn", "width": 8}, data={"name": "digits"}, **kw)


def _distinct_label_samples(task: ImageClassification, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` training samples whose labels differ from their neighbour's (MixUp pairs i with i - 1)."""
    train, out, last = task.data.train, [], None
    for i in range(len(train)):
        x, y = train.images[i], train.labels[i]
        if y != last:
            out.append((x, y))
            last = y
        if len(out) == n:
            break
    assert out[0][1] != out[-1][1]  # the roll wraps around
    return out


def test_mixup_rows_sum_to_one_and_mix_two_classes_as_the_images_do() -> None:
    task = _task(mixup_alpha=0.4)
    samples = _distinct_label_samples(task)
    torch.manual_seed(0)
    x, y = task.train_collate_fn()(samples)
    images, labels = default_collate(samples)
    assert y.shape == (8, 10) and y.dtype == torch.float32
    torch.testing.assert_close(y.sum(-1), torch.ones(8), rtol=0, atol=1e-6)
    assert ((y > 0).sum(-1) == 2).all()
    lam = y[0, labels[0]]  # one weight for the whole batch: image i + the previous one
    assert 0 < lam < 1
    torch.testing.assert_close(y[torch.arange(8), labels], torch.full((8,), float(lam)))
    torch.testing.assert_close(y[torch.arange(8), labels.roll(1)], torch.full((8,), 1 - float(lam)))
    torch.testing.assert_close(x, lam * images + (1 - lam) * images.roll(1, 0), rtol=0, atol=1e-6)


def test_cutmix_pastes_a_box_whose_area_is_the_label_weight() -> None:
    # image i is filled with i: each pixel tells which image it came from
    samples = [(torch.full((1, 8, 8), float(i)), torch.tensor(i)) for i in range(8)]
    torch.manual_seed(1)
    x, y = _task(cutmix_alpha=1.0).train_collate_fn()(samples)
    own = torch.arange(8.0)[:, None, None, None]
    torch.testing.assert_close(y.sum(-1), torch.ones(8), rtol=0, atol=1e-6)
    assert ((x == own) | (x == own.roll(1, 0))).all()  # each pixel its own or the previous image's
    kept = (x == own).float().mean((1, 2, 3))
    assert 0 < kept[0] < 1  # a box was pasted (one box for the whole batch)
    torch.testing.assert_close(y[torch.arange(8), torch.arange(8)], kept, rtol=0, atol=1e-6)


def test_both_alphas_choose_one_mix_per_batch_and_zero_alphas_keep_the_collate() -> None:
    both = _task(mixup_alpha=0.2, cutmix_alpha=1.0).train_collate_fn()
    assert isinstance(both, MixCollate) and len(both.mix.transforms) == 2
    plain = _task()
    assert plain.train_collate_fn() is None is plain.collate_fn()
    samples = _distinct_label_samples(plain)
    x, y = SeededCollate(plain.train_collate_fn())([(i, s) for i, s in enumerate(samples)])
    want_x, want_y = default_collate(samples)
    assert torch.equal(x, want_x) and torch.equal(y, want_y)


def test_the_loop_seeds_each_batch_mix_by_its_samples() -> None:
    collate = SeededCollate(_task(mixup_alpha=0.4).train_collate_fn())
    items = list(enumerate(_distinct_label_samples(_task())))
    torch.manual_seed(0)
    a = collate(items)
    torch.manual_seed(123)  # the global RNG (a worker's, or the main process's) does not matter
    b = collate(items)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(collate([(7, s) for _, s in items])[1], a[1])  # another seed, another mix


def test_soft_target_loss_with_label_smoothing_and_argmax_accuracy() -> None:
    task = _task(label_smoothing=0.1)
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    soft = torch.softmax(torch.randn(4, 10), -1)
    out = task.step(lambda x: logits, (torch.zeros(4, 1, 8, 8), soft))
    # reference: the smoothed target (1 - eps) y + eps / C against log-softmax, float64
    target = 0.9 * soft.double() + 0.1 / 10
    want = -(target * torch.log_softmax(logits.double(), -1)).sum(-1).mean()
    torch.testing.assert_close(out.loss.double(), want, rtol=1e-6, atol=0)
    assert out.metrics["accuracy"] == (logits.argmax(-1) == soft.argmax(-1)).float().mean()


# ---- top-5 accuracy -------------------------------------------------------------------------------------


def test_top5_accuracy_counts_the_label_among_the_five_largest() -> None:
    task = _task()
    logits = torch.arange(10.0).repeat(3, 1)  # class 9 largest, then 8, 7, ...
    y = torch.tensor([9, 5, 4])  # top-1, 5th, 6th
    out = task.step(lambda x: logits, (torch.zeros(3, 1, 8, 8), y))
    assert float(out.metrics["accuracy"]) == pytest.approx(1 / 3)
    assert float(out.metrics["accuracy_top5"]) == pytest.approx(2 / 3)
    few = task.step(lambda x: logits[:, :5], (torch.zeros(3, 1, 8, 8), torch.tensor([4, 0, 1])))
    assert "accuracy_top5" not in few.metrics  # five classes or fewer: always 1


# ---- channels-last --------------------------------------------------------------------------------------


def test_channels_last_lays_out_weights_and_images_and_keeps_the_result() -> None:
    plain, last = _task(), _task(channels_last=True)
    torch.manual_seed(0)
    a = plain.build_model()
    b = last.build_model()
    b.load_state_dict(a.state_dict())
    conv = next(m for m in b.modules() if isinstance(m, nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    batch = default_collate([plain.data.val[i] for i in range(16)])
    moved = last.on_device(b, batch)
    assert moved[0].is_contiguous(memory_format=torch.channels_last)
    a.eval(), b.eval()
    with torch.no_grad():
        torch.testing.assert_close(b(moved[0]), a(batch[0]), rtol=1e-4, atol=1e-5)  # layout only: fp32 sums


# ---- weight-decay groups --------------------------------------------------------------------------------


def _groups(model: nn.Module) -> tuple[set[str], set[str]]:
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    name = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    return {name[id(p)] for p in decay["params"]}, {name[id(p)] for p in no_decay["params"]}


def test_vit_tokens_norms_and_biases_are_not_decayed() -> None:
    model = ViT(num_classes=10, in_channels=1, image_size=8, dim=16, depth=1, heads=2)
    decay, no_decay = _groups(model)
    assert {"cls", "pos", "norm.weight", "norm.bias", "head.bias", "patch.bias"} <= no_decay
    params = dict(model.named_parameters())
    assert decay == {n for n, p in params.items() if p.ndim >= 2} - {"cls", "pos"}
    assert "patch.weight" in decay and "head.weight" in decay


def test_embeddings_are_not_decayed_unless_tied_to_an_output_matrix() -> None:
    model = nn.ModuleDict({"emb": nn.Embedding(5, 4), "pos": nn.Embedding(3, 4), "head": nn.Linear(4, 5)})
    decay, no_decay = _groups(model)
    assert decay == {"head.weight"} and no_decay == {"emb.weight", "pos.weight", "head.bias"}
    model["head"].weight = model["emb"].weight  # tied: the table is also the head's matrix
    decay, _ = _groups(model)
    assert decay == {"emb.weight"}


# ---- EMA ------------------------------------------------------------------------------------------------


def test_ema_equals_its_closed_form_after_k_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    shadow = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    trainer = SimpleNamespace(
        model=model,
        state=SimpleNamespace(step=0),
        shape=SimpleNamespace(dp_shard=1, tp=1),
        task=SimpleNamespace(build_model=lambda: shadow),
    )
    ema = EMA(0.9, every=2, warmup=2)  # an update every 2 steps decays by 1 - 2 x 0.1 = 0.8
    ema.on_fit_start(trainer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    for step in range(1, 9):
        loss = model(torch.randn(8, 3)).square().mean()  # train mode: the running stats move too
        loss.backward()
        opt.step()
        opt.zero_grad()
        trainer.state.step = step
        ema.on_step_end(trainer, {})
        seen[step] = {k: v.detach().clone().double() for k, v in model.state_dict().items()}
    # steps 2 (warm-up) and 4 copy (the warm-up left nothing averaged); 6 and 8 average at 0.8
    for key in ("0.weight", "0.bias", "1.weight", "1.running_mean", "1.running_var"):
        want = 0.8 * (0.8 * seen[4][key] + 0.2 * seen[6][key]) + 0.2 * seen[8][key]
        got = ema.state_dict()[key].double()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=key)  # float32 lerps
    assert int(ema.state_dict()["n_averaged"]) == 3


def _fit_digits(run_dir: Path, resume: str | None = None) -> Trainer:
    task = _task(mixup_alpha=0.2, cutmix_alpha=1.0, ema_decay=0.9, ema_every=2, ema_warmup=2)
    cfg = TrainerConfig(max_steps=8, batch_size=32, ckpt_every=4, progress=False, num_workers=2)
    t = Trainer(task, cfg, OptimConfig(), run_dir=run_dir, device="cpu", precision="fp32", resume=resume)
    t.fit()
    return t


def test_ema_resumes_bit_exact_from_a_mid_run_checkpoint(tmp_path: Path) -> None:
    straight = _fit_digits(tmp_path / "a")
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    mid = tmp_path / "a" / "checkpoints" / "step_00000004"
    shutil.copytree(mid, tmp_path / "b" / "checkpoints" / mid.name)
    resumed = _fit_digits(tmp_path / "b", resume="auto")
    _, a, meta = checkpoint.load(tmp_path / "a" / "checkpoints" / "step_00000008")
    _, b, _ = checkpoint.load(tmp_path / "b" / "checkpoints" / "step_00000008")
    ema_a, ema_b = a["callbacks"]["EMA"], b["callbacks"]["EMA"]
    assert ema_a.keys() == ema_b.keys() and "n_averaged" in ema_a
    for k, v in ema_a.items():
        assert torch.equal(v, ema_b[k]), k
    for k, v in straight.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    assert "val/ema_accuracy" in meta["metrics"] and "val/ema_accuracy_top5" in meta["metrics"]


# ---- end to end -----------------------------------------------------------------------------------------


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_cli_run_logs_ema_and_top5(cli_here, tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = cli_here(
        "+task=image_classification",
        "model.width=16",
        "trainer=smoke",
        "task.mixup_alpha=0.2",
        "task.cutmix_alpha=1.0",
        "task.ema_decay=0.99",
        "data.auto_augment=ta_wide",
        "data.random_erase=0.25",
        "logger=none",
        f"hydra.run.dir={run}",
    )
    assert r.returncode == 0, r.stderr
    rows = read_metrics(run)
    evals = [row for row in rows if "val/accuracy" in row]
    assert evals and {"val/ema_accuracy", "val/ema_loss", "val/accuracy_top5"} <= evals[-1].keys()


# ---- repeated augmentation ------------------------------------------------------------------------------


def test_repeated_augmentation_batches_hold_each_image_reps_times_and_cover_the_data() -> None:
    sampler = RepeatedAugmentationBatchSampler(100, 12, 3, seed=0)
    epoch0 = sampler.batches(0)
    assert len(epoch0) == 9 and all(len(b) == 12 for b in epoch0)  # ceil(100 / 12) full batches
    for batch in epoch0:
        distinct = batch[:4]
        assert len(set(distinct)) == 4 and batch == distinct * 3  # [a, b, c, d] three times over
    seen = [i for b in epoch0 for i in b[:4]]
    assert len(seen) == len(set(seen)) == 36  # no image twice in an epoch: 36 of 100 distinct
    assert sampler.batches(0) == RepeatedAugmentationBatchSampler(100, 12, 3, seed=0).batches(0)
    assert sampler.batches(1) != epoch0
    # a batch size that reps do not divide: 5 distinct, the batch cut at 13
    assert (
        RepeatedAugmentationBatchSampler(100, 13, 3, seed=0).batches(0)[0][5:10]
        == (RepeatedAugmentationBatchSampler(100, 13, 3, seed=0).batches(0)[0][:5])
    )


def test_copies_of_an_image_are_augmented_apart_and_the_same_on_a_second_pass() -> None:
    task = _task(aug_repeats=2)
    train = task.data.train
    sampler = task.batch_sampler(train, 8, train=True, seed=0)
    assert isinstance(sampler, RepeatedAugmentationBatchSampler)
    assert not isinstance(
        task.batch_sampler(task.data.val, 8, train=False, seed=0), RepeatedAugmentationBatchSampler
    )
    samples = SeededSamples(train)

    def first_batch() -> list[torch.Tensor]:
        keys = next(iter(SeededBatches(sampler, 0, 0)))
        return [samples[k][1][0] for k in keys]

    images = first_batch()
    idx = sampler.batches(0)[0]
    assert idx[:4] == idx[4:]
    for a, b in zip(images[:4], images[4:], strict=True):
        assert not torch.equal(a, b)  # the same digit, two augmentations
    for a, b in zip(images, first_batch(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # seeded: a resumed epoch sees the same pixels
    # a batch without repeats keeps the seeds it had before repeated augmentation existed
    plain = next(iter(SeededBatches(ShuffledBatchSampler(len(train), 8, shuffle=True, seed=0), 0, 0)))
    assert [s for _, s in plain] == [derive_seed(0, "sample", 0, i) for i, _ in plain]


@pytest.mark.slow  # a whole CLI run or more: moved out of the default run (#31, make test-slow)
def test_aug_repeats_trains_from_the_command_line(tmp_path: Path) -> None:
    from tests.helpers import train

    run = train(tmp_path / "run", ["+task=image_classification", "task.aug_repeats=3", "trainer.max_steps=4"])
    rows = read_metrics(run)
    assert max(r["step"] for r in rows) == 4 and any("val/accuracy" in r for r in rows)


def test_with_as_many_ranks_as_repeats_each_rank_gets_one_copy_of_every_image() -> None:
    sampler = RepeatedAugmentationBatchSampler(50, 8, 2, seed=3)
    shares = [next(iter(SeededBatches(sampler, 3, 0, (rank, 2)))) for rank in range(2)]
    assert [i for i, _ in shares[0]] == [i for i, _ in shares[1]] == sampler.batches(0)[0][:4]
    assert all(a != b for (_, a), (_, b) in zip(*shares, strict=True))  # augmented apart across ranks


# ---- gradient accumulation ------------------------------------------------------------------------------


@pytest.mark.parametrize("mixup", [0.0, 0.4])
def test_unequal_micro_batches_accumulate_to_one_batch_of_their_images(mixup: float) -> None:
    task = _task(mixup_alpha=mixup)
    torch.manual_seed(0)
    model = task.build_model().double().eval()  # eval: batch norm and dropout see no batch statistics
    samples = _distinct_label_samples(task)
    torch.manual_seed(0)
    x, y = (task.train_collate_fn() or default_collate)(samples)  # MixUp: soft labels, a mean over images
    micro = [(x[:3], y[:3]), (x[3:], y[3:])]
    assert [task.loss_units(b) for b in micro] == [3, 5]

    def ready(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return b[0].double(), b[1]  # (the task's loss is taken in float32: MixUp's labels stay so)

    want = one_batch_grads(task, model, (x, y), ready)
    got = accumulated_grads(task, model, micro, ready)
    assert max_deviation(got, want) < 1e-10  # float64, summation order
    assert max_deviation(mean_of_means_grads(task, model, micro, ready), want) > 1e-6
