"""Cancel and lease checks inside long work: the hub download, the streamed reference, the gates.

A worker installs its lease check for a stage (exporter.checkpoints); these tests install a check
that raises once asked N times and see the work stop there, with the check's own exception.
"""

from __future__ import annotations

import threading

import pytest

from exporter import checkpoints


class Stop(Exception):
    pass


class Countdown:
    """A check that lets ``allowed`` calls pass, then raises Stop (a cancel arriving mid-work)."""

    def __init__(self, allowed: int):
        self.allowed, self.calls = allowed, 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.calls += 1
            if self.calls > self.allowed:
                raise Stop(f"stopped at checkpoint {self.calls}")


def test_a_checkpoint_without_a_check_does_nothing_and_with_one_raises_its_exception():
    checkpoints.checkpoint()
    with checkpoints.installed(Countdown(0)):
        with pytest.raises(Stop) as raised:
            checkpoints.checkpoint()
        wrapped = RuntimeError("cannot download")
        wrapped.__cause__ = raised.value
        assert checkpoints.is_stop(raised.value) and checkpoints.is_stop(wrapped)
        assert not checkpoints.is_stop(RuntimeError("a real download failure"))
        with pytest.raises(Stop) as again:  # a second stop (another download thread) does not hide the first
            checkpoints.checkpoint()
        assert checkpoints.is_stop(raised.value) and checkpoints.is_stop(again.value)
    checkpoints.checkpoint()  # uninstalled again


def test_the_streamed_reference_stops_between_layers(tmp_path):
    """A cancel during validation's reference pass over a model stops it at the next layer."""
    import torch

    from exporter.tiny_checkpoint import make_tiny_checkpoint
    from exporter.validation.streamed import StreamedReference

    checkpoint = make_tiny_checkpoint("llama", tmp_path / "tiny")
    reference = StreamedReference(checkpoint)
    try:
        layers = len(reference.layers)
        assert layers >= 2
        countdown = Countdown(1)
        with checkpoints.installed(countdown), pytest.raises(Stop):
            reference(input_ids=torch.tensor([[1, 2, 3]]))
        assert countdown.calls == 2  # the first layer ran, the second did not
        reference(input_ids=torch.tensor([[1, 2, 3]]))  # and it still works for the next run
    finally:
        reference.close()


def test_the_weight_gate_stops_at_its_next_tensor(tmp_path):
    from exporter.packaging.checkpoint import Checkpoint
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.tiny_checkpoint import make_tiny_checkpoint
    from exporter.validation.gates.weights import weight_integrity

    source = make_tiny_checkpoint("qwen2", tmp_path / "tiny")
    result = export_model(ExportRequest(model=str(source), dtype="fp32", ep="cpu", variant="attn_dynamic"),
                          tmp_path / "export", validate=False)
    countdown = Countdown(3)
    with checkpoints.installed(countdown), pytest.raises(Stop):
        weight_integrity(tmp_path / "export" / "model.onnx", result.manifest.data, Checkpoint(source), "fp32", "fp32")
    assert countdown.calls > 3  # asked per tensor (jobs already queued on its threads each stop at once)


def test_a_hub_download_stops_within_a_chunk(monkeypatch):
    """snapshot_download's byte progress is a checkpoint: a stop raised there leaves resolve as the
    stop itself, not as the "cannot download" error a network failure becomes."""
    import huggingface_hub

    from exporter.packaging import resolve

    def fake_download(repo_id, tqdm_class=None, **kwargs):  # the hub is unreachable here: its progress bar is real
        bar = tqdm_class(total=4 << 30, unit="B")
        for _ in range(8):
            bar.update(1 << 20)
        raise AssertionError("the download was not stopped")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    countdown = Countdown(2)
    with checkpoints.installed(countdown), pytest.raises(Stop):
        resolve._download("org/name", None)
    assert countdown.calls == 3
