"""`core.loop.task.Task.export_inputs`'s default: what an (inputs, targets) task's model takes once
exported."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from core.errors import ExportError
from tests.core.toy_task import ToyTask
from tests.helpers import fault


def test_the_default_exports_the_inputs_with_a_dynamic_batch() -> None:
    task = ToyTask()
    model = task.build_model().eval()
    _, val = task.build_datasets()
    inputs = task.export_inputs(model, default_collate([val[i] for i in range(4)]))
    assert inputs.module is model and inputs.args[0].shape == (4, 4) and inputs.length is None
    program = torch.export.export(inputs.module, inputs.args, dynamic_shapes=inputs.dynamic_shapes).module()
    one = default_collate([val[5]])[0]
    with torch.no_grad():  # the batch dim is dynamic down to 1; same ops: exact
        assert torch.equal(program(one), model(one))


def test_a_task_with_other_batches_is_told_to_say_what_its_model_takes() -> None:
    task = ToyTask()
    with pytest.raises(ExportError) as e:
        task.export_inputs(task.build_model(), {"x": torch.zeros(2, 4)})
    assert fault(e.value) == ("export_inputs", "ToyTask", ())
