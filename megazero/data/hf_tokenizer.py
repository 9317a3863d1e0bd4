"""megazero's tokenizers as a `tokenizers` pipeline (tokenizer.json) that transformers loads.

`AutoTokenizer.from_pretrained(DIR)` then encodes and decodes ordinary text exactly as
megazero's tokenizer does:

  gpt2bpe        the same vocab.json/merges.txt behind a byte-level pre-tokenizer and decoder;
                 <|endoftext|> is the special bos/eos/unk token, as in GPT-2's own files.
  sentencepiece  rebuilt from the .model file: its normalizer (precompiled character map,
                 whitespace handling, dummy prefix, U+2581 for spaces), its pieces and scores
                 (unigram: the pieces as they are; BPE: merges ranked by the merged piece's
                 score, as SentencePiece merges), byte fallback, and its decoder. The model
                 file is a protobuf; the few fields needed are read from its wire format,
                 so protobuf itself is not needed.

What cannot be expressed exactly that way (SentencePiece's word/char models, whitespace as
a suffix, user-defined pieces) raises DataError naming the setting.
"""

from __future__ import annotations

import json
from typing import Any

from megazero.data import DataError
from megazero.data.tokenizer import EOD_TOKEN, GPT2BPETokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer

SPACE = "\u2581"  # SentencePiece's visible space
SPM_UNIGRAM, SPM_BPE = 1, 2
SPM_USER_DEFINED = 4  # a piece type: matched in the text as a whole, before the model runs


def hf_tokenizer_files(tok: Tokenizer, model_max_length: int) -> dict[str, str]:
    """{file name: text} of tokenizer.json and tokenizer_config.json for transformers."""
    from tokenizers import Tokenizer as Pipeline
    from tokenizers import processors

    if isinstance(tok, GPT2BPETokenizer):
        pipeline = Pipeline.from_str(tok.pipeline_json())  # a copy: megazero's own keeps EOD as plain text
        pipeline.post_processor = processors.ByteLevel(trim_offsets=False)
        _special(pipeline, [EOD_TOKEN])
        special = dict.fromkeys(("bos_token", "eos_token", "unk_token"), EOD_TOKEN)
    elif isinstance(tok, HFTokenizer):  # already a tokenizer.json: as it is, with its eos
        pipeline, special = Pipeline.from_str(tok.pipeline_json()), {"eos_token": tok.token(tok.eod)}
    else:
        pipeline, special = _sentencepiece_pipeline(tok)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": model_max_length,
              # megazero's decode leaves spaces before punctuation as they are
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
    return {"tokenizer.json": pipeline.to_str(pretty=True), "tokenizer_config.json": json.dumps(config, indent=2)}


def _special(pipeline: Any, names: list[str]) -> None:
    from tokenizers import AddedToken
    pipeline.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])


# ----------------------------------------------------------------------------- SentencePiece


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _proto_fields(buf: bytes) -> dict[int, list[Any]]:
    """Field number -> values of one protobuf message (varints as ints, the rest as bytes)."""
    fields: dict[int, list[Any]] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i: i + size], i + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, i = buf[i: i + size], i + size
        else:
            raise DataError(f"unreadable SentencePiece model (protobuf wire type {wire})")
        fields.setdefault(number, []).append(value)
    return fields


def _field(fields: dict[int, list[Any]], number: int, default: Any) -> Any:
    return fields[number][-1] if number in fields else default


def _spm_specs(model_file: str) -> tuple[dict, dict, list[str]]:
    """(trainer_spec, normalizer_spec) field maps of a .model file (ModelProto fields 2 and
    3) and its user-defined pieces (fields 1: SentencePiece messages, piece 1, type 3)."""
    with open(model_file, "rb") as f:
        model = _proto_fields(f.read())
    pieces = [_proto_fields(p) for p in model.get(1, [])]
    user_defined = [_field(p, 1, b"").decode() for p in pieces if _field(p, 3, 1) == SPM_USER_DEFINED]
    return _proto_fields(_field(model, 2, b"")), _proto_fields(_field(model, 3, b"")), user_defined


def _sentencepiece_pipeline(tok: SentencePieceTokenizer) -> tuple[Any, dict[str, str]]:
    import sentencepiece as spm
    from tokenizers import Tokenizer as Pipeline
    from tokenizers import decoders

    trainer, normalizer, user_defined = _spm_specs(tok.files[0])
    model_type, byte_fallback = _field(trainer, 3, SPM_UNIGRAM), bool(_field(trainer, 35, 0))
    if _field(trainer, 24, 0):
        raise DataError(f"tokenizer {tok.spec!r}: treat_whitespace_as_suffix has no tokenizer.json equivalent")
    if user_defined:  # transformers would match them before normalizing, SentencePiece after
        raise DataError(f"tokenizer {tok.spec!r}: user-defined pieces ({', '.join(user_defined[:3])}) have no "
                        f"exact tokenizer.json equivalent")
    sp = spm.SentencePieceProcessor(model_file=tok.files[0])
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    if model_type == SPM_UNIGRAM:
        from tokenizers.models import Unigram
        model = Unigram(pieces, unk_id=sp.unk_id(), byte_fallback=byte_fallback)
    elif model_type == SPM_BPE:
        model = _spm_bpe_model(sp, pieces, byte_fallback)
    else:
        raise DataError(f"tokenizer {tok.spec!r}: SentencePiece model type {model_type} (word/char) "
                        "has no tokenizer.json equivalent; train it with --model-type bpe or unigram")
    pipeline = Pipeline(model)
    add_dummy_prefix = bool(_field(normalizer, 3, 1))
    pipeline.normalizer = _spm_normalizer(normalizer, add_dummy_prefix)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_dummy_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    pipeline.decoder = decoders.Sequence(steps)
    special = {"unk_token": sp.id_to_piece(sp.unk_id()), "eos_token": sp.id_to_piece(tok.eod)}
    if sp.bos_id() >= 0:
        special["bos_token"] = sp.id_to_piece(sp.bos_id())
    _special(pipeline, [p for i, (p, _) in enumerate(pieces) if sp.is_control(i) or sp.is_unknown(i)])
    return pipeline, special


def _spm_normalizer(spec: dict[int, list[Any]], add_dummy_prefix: bool) -> Any:
    """SentencePiece's normalization in its order: character map, whitespace cleanup,
    dummy prefix, spaces made visible."""
    from tokenizers import Regex, normalizers

    steps: list[normalizers.Normalizer] = []
    charsmap = _field(spec, 2, b"")
    if charsmap:
        steps.append(normalizers.Precompiled(charsmap))
    if _field(spec, 4, 1):  # remove_extra_whitespaces: strip the ends, collapse runs of spaces
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if _field(spec, 5, 1):  # escape_whitespaces
        steps.append(normalizers.Replace(" ", SPACE))
    return normalizers.Sequence(steps)


def _spm_bpe_model(sp: Any, pieces: list[tuple[str, float]], byte_fallback: bool) -> Any:
    """SentencePiece BPE merges the adjacent pair whose merged piece scores highest; as a
    ranked merge list that is every split of every normal piece into two pieces, ordered by
    the merged piece's score (ties: the left part's id, then the right part's)."""
    from tokenizers.models import BPE

    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    merges = []
    for i, (piece, score) in enumerate(pieces):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i):
            continue
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(-score, vocab[a], vocab[b], a, b) for a, b in splits]
    merges.sort()
    return BPE(vocab, [(a, b) for *_, a, b in merges], unk_token=sp.id_to_piece(sp.unk_id()), fuse_unk=True,
               byte_fallback=byte_fallback)
