"""fit() logs each epoch's row when the epoch ends, so the suite's progress moves during training."""

from sinkformer.data import load_dataset
from sinkformer.models import build_model
from sinkformer.runs import Run, fit
from sinkformer.runs.registry import on_log

def test_each_epoch_is_logged_as_it_ends(tmp_path):
    data = load_dataset("digits")
    model = build_model("vit", data.info, patch_size=4, dim=8, depth=1, num_heads=2, dim_feedforward=8)
    forwards = []  # training forward passes so far
    model.register_forward_hook(lambda m, args, out: forwards.append(1) if m.training else None)
    logged_after = []  # the number of training forwards when each row was logged
    ctx = Run("probe", {}, tmp_path)
    with on_log(lambda run, row: logged_after.append(len(forwards))):
        result = fit(model, data, {"epochs": 3, "batch_size": 64, "max_train_batches": 2, "max_eval_batches": 1},
                     seed=0, ctx=ctx, model="vit")
    assert logged_after == [2, 4, 6]  # after each epoch's 2 batches, not all at the end
    rows = list((tmp_path / "metrics.csv").read_text().splitlines())
    assert len(rows) == 1 + 3 and rows[0].startswith("model,seed,epoch")
    assert [r["epoch"] for r in result.history] == [1, 2, 3]
