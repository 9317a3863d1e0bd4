"""Fine-tuning data: prompt/completion JSONL -> an indexed dataset plus its loss mask, and the
samples the dataset makes of it (one example a sample by default, or packed when asked)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import EXAMPLES, documents, run, write_masked
from megazero.data import DataError
from megazero.data.gpt_dataset import IGNORE_INDEX, GPTDataset, build_train_valid_test_datasets, inputs_and_labels
from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter, loss_mask_prefix
from megazero.data.tokenizer import build_tokenizer


def write_examples(path: Path, records: list, raw_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(raw_lines), encoding="utf-8")
    return path


def test_examples_are_written_with_their_loss_mask(cli, capsys, tmp_path: Path, bpe_spec: str) -> None:
    src = write_examples(tmp_path / "qa.jsonl", EXAMPLES)
    code, stdout, _ = run(cli, capsys, "--input", str(src), "--prompt-key", "prompt", "--completion-key", "completion",
                          "--tokenizer", bpe_spec, "--output-prefix", str(tmp_path / "qa"))
    assert code == 0, stdout
    tok = build_tokenizer(bpe_spec)
    prefix = tmp_path / "qa_prompt_completion_document"
    expected = [tok.encode(e["prompt"]) + tok.encode(e["completion"]) + [tok.eod] for e in EXAMPLES]
    assert documents(prefix) == expected
    mask = IndexedDataset(loss_mask_prefix(prefix))
    assert mask.dtype == np.uint8
    assert np.array_equal(mask.document_indices, IndexedDataset(prefix).document_indices)
    for i, e in enumerate(EXAMPLES):
        n_prompt = len(tok.encode(e["prompt"]))
        assert mask[i].tolist() == [0] * n_prompt + [1] * (len(expected[i]) - n_prompt)


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a"}\n', "qa.jsonl:4: no key 'completion' (keys: 'prompt'); pick one with --prompt-key/--completion-key"),
    ('{"prompt": "a", "completion": "  "}\n', "qa.jsonl:4: 'completion' is empty; give every example a non-empty "
                                               "completion, drop the line, or pass --skip-bad-lines"),
    ('{"prompt": "a", "completion"\n', "qa.jsonl:4: not valid JSON"),
])
def test_bad_example_is_one_line_with_its_number(cli, capsys, tmp_path: Path, bpe_spec: str, line: str,
                                                 message: str) -> None:
    src = write_examples(tmp_path / "qa.jsonl", EXAMPLES, (line,))
    code, _, err = run(cli, capsys, "--input", str(src), "--prompt-key", "prompt", "--tokenizer", bpe_spec,
                       "--output-prefix", str(tmp_path / "qa"))
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not list(tmp_path.glob("qa_*"))


def test_one_example_per_sample_padded_or_truncated(tmp_path: Path, capsys) -> None:
    lengths = [3, 9, 5, 20, 7, 30]
    prefix = write_masked(tmp_path / "ft", lengths)
    ds = GPTDataset(IndexedDataset(prefix), (0, 6), 8, 1, 12, str(tmp_path), True)
    assert ds.loss_masked and "2 of 6 examples are longer than seq_length + 1 (9) tokens" in capsys.readouterr().err
    indexed = IndexedDataset(prefix)
    for epoch in range(2):  # each epoch holds every example once, from its first token
        seen = set()
        for i in range(6 * epoch, 6 * epoch + 6):
            sample = ds[i]
            assert np.array_equal(sample.loss_mask, sample.tokens % 2)
            n = int((sample.tokens != 0).sum())
            doc = next(d for d in range(6) if np.array_equal(indexed[d][:9], sample.tokens[:n]) and min(lengths[d], 9) == n)
            seen.add(doc)
        assert seen == set(range(6))
    inputs, labels = inputs_and_labels([ds[0], ds[1]])
    assert inputs.shape == labels.shape == (2, 8)
    masked = next(ds[i] for i in range(12) if (ds[i].loss_mask[1:] == 0).any())
    alone = inputs_and_labels([masked])  # one row: its label slice is contiguous, yet no view of the inputs
    assert np.array_equal(alone[0][0], masked.tokens[:-1]) and (alone[1] == IGNORE_INDEX).any()
    for row, sample in enumerate([ds[0], ds[1]]):
        counted = sample.loss_mask[1:] == 1
        assert np.array_equal(labels[row][counted], sample.tokens[1:][counted])
        assert (labels[row][~counted] == IGNORE_INDEX).all()


def test_packed_examples_carry_their_mask(tmp_path: Path) -> None:
    prefix = write_masked(tmp_path / "ft", [3, 9, 5, 20, 7, 30])
    packed = GPTDataset(IndexedDataset(prefix), (0, 6), 8, 1, 10, str(tmp_path), True, pack_examples=True)
    assert not packed.one_example_per_sample
    for i in range(10):
        assert np.array_equal(packed[i].loss_mask, packed[i].tokens % 2) and packed[i].tokens.min() > 0


def test_plain_data_blends_with_examples(tmp_path: Path) -> None:
    write_masked(tmp_path / "ft", [12] * 20)
    with IndexedDatasetWriter(tmp_path / "plain", np.uint16) as w:
        for d in range(20):
            w.add_document(np.arange(1, 13) + d)
        w.finalize()
    train, _, _ = build_train_valid_test_datasets([str(tmp_path / "ft"), str(tmp_path / "plain")], "1", 8, 1,
                                                  (16, 0, 0), None, True)
    assert train.loss_masked
    samples = [train[i] for i in range(16)]
    assert {type(s).__name__ for s in samples} == {"Example", "ndarray"}
    _, labels = inputs_and_labels(samples)
    plain_rows = [r for r, s in enumerate(samples) if not hasattr(s, "loss_mask")]
    assert (labels[plain_rows] >= 0).all() and (labels < 0).any()


def test_mismatched_mask_is_refused(tmp_path: Path) -> None:
    write_masked(tmp_path / "a", [5, 6])
    write_masked(tmp_path / "b", [5, 7])
    for suffix in (".bin", ".idx"):
        (tmp_path / f"b_loss_mask{suffix}").replace(tmp_path / f"a_loss_mask{suffix}")
    with pytest.raises(DataError, match="loss mask .*a_loss_mask' .* does not match dataset"):
        GPTDataset(IndexedDataset(tmp_path / "a"), (0, 2), 4, 1, 2, str(tmp_path), True)


def test_merge_keeps_the_loss_masks(cli, capsys, tmp_path: Path, bpe_spec: str) -> None:
    for name, records in (("a", EXAMPLES[:2]), ("b", EXAMPLES[2:])):
        run(cli, capsys, "--input", str(write_examples(tmp_path / f"{name}.jsonl", records)), "--prompt-key", "prompt",
            "--tokenizer", bpe_spec, "--output-prefix", str(tmp_path / name))
    parts = [str(tmp_path / f"{n}_prompt_completion_document") for n in "ab"]
    assert run(cli, capsys, "--merge", *parts, "--output-prefix", str(tmp_path / "m"))[0] == 0
    merged = IndexedDataset(loss_mask_prefix(tmp_path / "m"))
    assert [merged[i].tolist() for i in range(3)] == [IndexedDataset(loss_mask_prefix(p))[i].tolist()
                                                     for p in parts for i in range(len(IndexedDataset(p)))]
    run(cli, capsys, "--input", str(write_examples(tmp_path / "t.jsonl", [{"text": "plain"}])), "--tokenizer", bpe_spec,
        "--output-prefix", str(tmp_path / "t"))
    code, _, err = run(cli, capsys, "--merge", parts[0], str(tmp_path / "t_text_document"), "--output-prefix",
                       str(tmp_path / "x"))
    assert code == 2 and "has a loss mask (fine-tuning examples) but" in err and not (tmp_path / "x.idx").exists()


def test_a_set_the_script_derived_is_rebuilt_when_its_tokenizer_changes(cli, capsys, tmp_path: Path, bpe_spec: str,
                                                                      spm_spec: str) -> None:
    """scripts/finetune_gpt.sh's check (megazero.harness.derived_data): a set with its manifest
    is kept for the same tokenizer files wherever they are, rebuilt for another; a set without
    one is the user's, except at the script's own place (made by an older script)."""
    import shutil

    from megazero.harness.derived_data import rebuild_reason, record
    src = write_examples(tmp_path / "qa.jsonl", EXAMPLES)
    prefix = str(tmp_path / "qa_prompt_completion_document")
    assert rebuild_reason(prefix, bpe_spec, own_place=False) == f"building {prefix} with tokenizer {bpe_spec}"
    assert run(cli, capsys, "--input", str(src), "--prompt-key", "prompt", "--completion-key", "completion",
               "--tokenizer", bpe_spec, "--output-prefix", str(tmp_path / "qa"))[0] == 0
    stale = f"rebuilding {prefix}: it was made with tokenizer {bpe_spec}, not {spm_spec}"
    assert rebuild_reason(prefix, spm_spec, own_place=False) is None  # no manifest: the user's own set
    assert rebuild_reason(prefix, spm_spec, own_place=True) == stale  # an older script's, at its own place
    assert rebuild_reason(prefix, bpe_spec, own_place=True) is None
    record(prefix, bpe_spec)
    assert rebuild_reason(prefix, spm_spec, own_place=False) == stale
    moved = shutil.copytree(bpe_spec.partition(":")[2], tmp_path / "elsewhere")
    assert rebuild_reason(prefix, f"gpt2bpe:{moved}", own_place=False) is None  # the same files elsewhere
