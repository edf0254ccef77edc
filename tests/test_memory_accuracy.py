"""The memory model against the real peak of live tensor memory per rank on gloo ranks
(experiments.memory_accuracy, a dispatch-level count of live storages that does not move between
runs): a zoo model under megatron with Duplex (the loss replicated: its backward's scratch) and a
`transformers` Llama under fsdp with Duplex in bf16 (its weights gathered in bf16 buckets, the
collectives' send buffers), each rank within 5%."""
import pytest

pytest.importorskip("transformers")

from experiments.memory_accuracy import Case, run, table  # noqa: E402


@pytest.mark.slow
def test_predicted_peaks_are_within_five_percent_of_the_measured_ones():
    cases = [Case("gpt:small", "megatron", 2), Case("hf-llama", "fsdp", 2, "none", "bf16")]
    rows = run(cases)
    assert len(rows) == 2 * len(cases)
    for row in rows:
        assert row["measured_mib"] > row["held_mib"] > 0, row  # a step allocates beyond it
        assert abs(row["error"]) <= 0.05, table(rows)
