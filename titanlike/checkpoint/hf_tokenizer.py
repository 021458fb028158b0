"""The tokenizer an HF export carries (titanlike/checkpoint/hf.py's export_hf): which one the run used, its ids for
config.json / generation_config.json, and its files in a form transformers' AutoTokenizer loads.

Every format of data.tokenizer (titanlike/data/tokenizers/) maps to a tokenizer.json built with the `tokenizers`
library (no transformers needed to write it): HF json / GPT-2 / builtin as they are, a tiktoken rank file as a
byte-level BPE, a sentencepiece model (BPE or unigram) as the same model with its normalisation; the NullTokenizer
has no equivalent (ids only). When transformers is installed the written files are loaded back and must encode a
probe text exactly as the run's tokenizer does, else they are removed again: no tokenizer is better than a wrong one.

A run that trained on chat data (data.dataset="chat", or data.chat_template set) exports its template as
chat_template.jinja (which transformers prefers to tokenizer_config.json's), checked the same way: transformers'
apply_chat_template must render and tokenise a probe conversation as the run did, else the template is left out.
The template's end-of-turn token joins generation_config.json's stop ids when it is one token.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from titanlike.checkpoint.layout import CONFIG, CheckpointError

logger = logging.getLogger("titanlike")

# Text the exported tokenizer must encode exactly as the run's did (words, digits, accents, CJK, emoji, runs of
# spaces, tabs and newlines: where pre-tokenisers and normalisers differ).
PROBE = "Hello world: the 2 cats, 1234 naïve café -- 東京 🚀\n\n\tindented  twice   spaced.\r\nend"
PROBE_CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"},
              {"role": "assistant", "content": "4, naïvely."}, {"role": "user", "content": "And 東京?"}]


def find_tokenizer(step: str, explicit: str | None):
    """(tokenizer, its data config) for an export: `explicit` (a file or folder), else the run's [data] in the
    step's config.toml, else the tokenizer/ folder an HF import wrote beside the step; None when none is known."""
    from titanlike.config.sections import Data
    from titanlike.data.tokenizers import build_tokenizer

    cfg_path, imported = os.path.join(step, CONFIG), os.path.join(os.path.dirname(step), "tokenizer")
    if explicit:
        data, where = Data(tokenizer=explicit), f"--tokenizer {explicit}"
    elif os.path.isfile(cfg_path):
        with open(cfg_path, "rb") as f:
            raw = tomllib.load(f).get("data", {})
        known = {f.name for f in dataclasses.fields(Data)}  # keys a later version dropped are ignored
        data = Data(**{k: v for k, v in raw.items() if k in known})
        where = f"data.tokenizer={data.tokenizer_model or data.tokenizer!r} in {cfg_path}"
    elif any(os.path.isfile(os.path.join(imported, n)) for n in ("tokenizer.json", "tokenizer.model")):
        data, where = Data(tokenizer=imported), imported
    else:
        return None
    try:
        return build_tokenizer(data), data
    except (OSError, ValueError, ImportError) as e:
        raise CheckpointError(f"export: cannot build the run's tokenizer ({where}): {e} -- give --tokenizer PATH, "
                              f"or --no-tokenizer to export without one") from None


def token_ids(tok, step: str) -> dict | None:
    """bos, eos and the ids generation stops at (eos, and the document separator the model learnt to emit when it
    differs); without a tokenizer, an import's own config.json ids (kept as hf_config.json); else None."""
    if tok is not None:
        t = tok[0]
        stop = list(dict.fromkeys([t.eos_id, t.eod_id, *_end_of_turn_id(*tok)]))
        return {"bos": t.bos_id, "eos": t.eos_id, "stop": stop[0] if len(stop) == 1 else stop}
    path = os.path.join(step, "hf_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            src = json.load(f)
        eos = src.get("eos_token_id")
        if eos is not None:
            return {"bos": src.get("bos_token_id"), "eos": eos, "stop": eos}
    return None


def run_chat_template(tok, data):
    """The chat template the run trained with (titanlike/data/chat.py), or None when it used none. A template that
    cannot be read any more raises ChatTemplateError."""
    if getattr(data, "dataset", "") != "chat" and not getattr(data, "chat_template", ""):
        return None
    from titanlike.data.chat import load_chat_template

    return load_chat_template(data, tok)


def _end_of_turn_id(tok, data) -> list[int]:
    """[the id generation of a reply stops at] when the run's template ends a turn with one token, else []."""
    from titanlike.data.chat import ChatTemplateError, end_of_turn

    try:
        template = run_chat_template(tok, data)
        if template is None or not (eot := end_of_turn(template).strip()):
            return []
        ids = tok.encode_with_offsets(eot)[0]
    except (ChatTemplateError, ValueError):  # said by write_tokenizer, which leaves the template out
        return []
    return ids if len(ids) == 1 else []


def _write_chat_template(tok, data, out: str, config: dict):
    """chat_template.jinja for the run's template (tokenizer_config.json's copy dropped: one source of truth)."""
    from titanlike.data.chat import ChatTemplateError

    try:
        template = run_chat_template(tok, data)
    except ChatTemplateError as e:
        logger.warning(f"export: the run's chat template cannot be read ({e}): the export has none of its own")
        return None
    if template is not None:
        config.pop("chat_template", None)
        with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(template.text)
    return template


def _chat_differs(hf, template, tok) -> str:
    """Why transformers' apply_chat_template on the export disagrees with the run's rendering ("" = it agrees)."""
    from titanlike.data.chat import render_with_masks

    try:
        text = hf.apply_chat_template(PROBE_CHAT, tokenize=False, add_generation_prompt=True)
        ids = hf.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    except Exception as e:  # noqa: BLE001 - a template transformers cannot run is not usable as written
        return f"cannot apply it ({type(e).__name__}: {str(e)[:200]})"
    if text != template.render(PROBE_CHAT, add_generation_prompt=True):
        return "renders a conversation differently than the run did"
    if list(ids) != render_with_masks(template, PROBE_CHAT, tok, add_generation_prompt=True)[0]:
        return "tokenises a rendered conversation differently than the run did"
    return ""


def write_tokenizer(tok, data, out: str, tokens: dict[str, int] | None = None) -> bool:
    """The HF tokenizer files for `tok` in `out` (beside config.json), checked against it with transformers'
    AutoTokenizer on PROBE when transformers is installed; files that do not load or encode differently are removed
    again (with a warning): no tokenizer is better than a wrong one. `tokens`: special tokens the model's family
    reads at fixed ids (llava's "<image>": its processor finds the placeholder id through the tokenizer), added at
    those ids. True when tokenizer.json was written and kept."""
    from titanlike.data.tokenizers.hf import HFTokenizer
    from titanlike.data.tokenizers.sentencepiece_model import SentencePieceTokenizer
    from titanlike.data.tokenizers.tiktoken_bpe import TiktokenTokenizer

    config = {"clean_up_tokenization_spaces": False, "model_input_names": ["input_ids", "attention_mask"]}
    if isinstance(tok, HFTokenizer):
        # The in-memory tokenizer the run used (GPT-2 vocab.json + merges.txt have no tokenizer.json); the
        # source folder's tokenizer_config.json (class, chat template) is kept, its bos/eos set below.
        hf_tok, src = _with_bos_rule(tok._tok, tok.bos_id, data.add_bos), tok.path.parent
        if (src / "tokenizer_config.json").is_file():
            config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
        if "add_bos_token" in config or hf_tok is not tok._tok:  # a class that reads it must agree with the file
            config.update(add_bos_token=bool(data.add_bos), add_eos_token=False)
        if (src / "chat_template.jinja").is_file():
            shutil.copy(src / "chat_template.jinja", os.path.join(out, "chat_template.jinja"))
    elif isinstance(tok, TiktokenTokenizer):
        hf_tok = tiktoken_to_hf(tok, data.add_bos)
    elif isinstance(tok, SentencePieceTokenizer):
        hf_tok = sentencepiece_to_hf(tok, data.add_bos)
    else:
        logger.info(f"export: {type(tok).__name__} has no Hugging Face equivalent: no tokenizer files; "
                    f"config.json and generation_config.json carry its ids (bos {tok.bos_id}, eos {tok.eos_id})")
        return False
    if hf_tok is None:
        return False
    if tokens and (hf_tok := _with_tokens(hf_tok, tokens)) is None:
        return False
    hf_tok.save(os.path.join(out, "tokenizer.json"))
    files = ["tokenizer.json", "tokenizer_config.json"]
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.update(bos_token=hf_tok.id_to_token(tok.bos_id), eos_token=hf_tok.id_to_token(tok.eos_id))
    template = _write_chat_template(tok, data, out, config)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1, ensure_ascii=False)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        logger.info("export: transformers is not installed: the tokenizer files were not checked")
        return True
    try:
        hf = AutoTokenizer.from_pretrained(out)
        ok = hf.encode(PROBE, add_special_tokens=False) == tok.encode(PROBE)
        why = "" if ok else "encodes text differently than the run's tokenizer"
        if ok and any(hf.encode(t, add_special_tokens=False) != [i] for t, i in (tokens or {}).items()):
            why = f"does not read {sorted(tokens)} as the model's ids {sorted(tokens.values())}"
    except Exception as e:  # noqa: BLE001 - whatever fails to load is not usable as written
        why = f"cannot load them ({type(e).__name__}: {str(e)[:200]})"
    if not why and template is not None and (chat_why := _chat_differs(hf, template, tok)):
        os.remove(os.path.join(out, "chat_template.jinja"))
        logger.warning(f"export: transformers' apply_chat_template {chat_why}: chat_template.jinja is left out "
                       f"(the tokenizer files are kept)")
    if why:
        for n in files + ["chat_template.jinja"]:
            if os.path.isfile(os.path.join(out, n)):
                os.remove(os.path.join(out, n))
        logger.warning(f"export: transformers' AutoTokenizer {why}: the {type(tok).__name__} files are left out; "
                       f"config.json and generation_config.json still carry its ids")
    return not why


def _with_tokens(hf_tok, tokens: dict[str, int]):
    """A copy of hf_tok holding each of `tokens` as a special token at its id; ids between the tokenizer's end and
    one of them become placeholder specials "<|unused_N|>" (the model's spare rows). None (with a warning) when an id
    is already another token of the tokenizer."""
    from tokenizers import AddedToken, Tokenizer

    copy = Tokenizer.from_str(hf_tok.to_str())  # the run's own tokenizer stays as it was
    for name, tid in sorted(tokens.items(), key=lambda kv: kv[1]):
        have, size = copy.token_to_id(name), copy.get_vocab_size(with_added_tokens=True)
        if have == tid:
            continue
        if have is not None or tid < size:
            logger.warning(f"export: the model reads {name} as id {tid}, which the tokenizer holds as "
                           f"{copy.id_to_token(tid)!r}{f' ({name} is {have})' if have is not None else ''}: no "
                           f"tokenizer or processor files; config.json carries the id")
            return None
        copy.add_special_tokens([AddedToken(f"<|unused_{i}|>", special=True, normalized=False)
                                 for i in range(size, tid)] + [AddedToken(name, special=True, normalized=False)])
    return copy


def adds_bos(hf_tok, bos_id: int) -> bool:
    """Whether a tokenizers.Tokenizer's post-processor prepends BOS (to what transformers' tokenizer(text) gives)."""
    ids = hf_tok.encode("a", add_special_tokens=True).ids
    return ids[:1] == [bos_id] and ids != hf_tok.encode("a", add_special_tokens=False).ids


def _with_bos_rule(hf_tok, bos_id: int, add_bos: bool):
    """The run's tokenizer.json, or a copy whose post-processor prepends BOS exactly when the run's documents started
    with it (data.add_bos): transformers' tokenizer(prompt) then gives the ids the model was trained to continue."""
    from tokenizers import Tokenizer, processors

    if adds_bos(hf_tok, bos_id) == bool(add_bos):
        return hf_tok
    copy = Tokenizer.from_str(hf_tok.to_str())
    if add_bos:
        bos = copy.id_to_token(bos_id)
        copy.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                            special_tokens=[(bos, bos_id)])
    else:  # ids without specials; offsets as a byte-level file's own post-processor gives them
        copy.post_processor = processors.ByteLevel(trim_offsets=False)
    return copy


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in which byte-level BPE tokenizer.json files spell tokens."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def tiktoken_to_hf(tok, add_bos: bool):
    """A tiktoken rank file as an HF byte-level BPE (tokenizers.Tokenizer) that encodes the same: merges recovered
    from the ranks (each token's splits into two tokens, in rank order), the same split regex, the same specials."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    from titanlike.data.tokenizers.tiktoken_bpe import load_rank_file

    ranks, chars = load_rank_file(tok.path), _byte_chars()

    def spell(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    merges = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(spell(a), spell(b)) for a, b in sorted(pairs, key=lambda p: (ranks[p[0]], ranks[p[1]]))]
    # ignore_merges: a piece that is itself a token is taken whole, as tiktoken does, before any merging.
    hf = Tokenizer(models.BPE({spell(t): r for t, r in ranks.items()}, merges, ignore_merges=True))
    # The regex the run's encoder split with (tiktoken keeps it only as Encoding._pat_str).
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tok._enc._pat_str), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s, _ in specials])
    if any(hf.token_to_id(s) != i for s, i in specials):
        raise CheckpointError(f"{tok.path}: its ranks are not 0..{len(ranks) - 1}, so the special tokens' ids "
                              f"cannot be kept in a tokenizer.json")
    bos = hf.id_to_token(tok.bos_id)
    hf.post_processor = (processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.bos_id)])
                         if add_bos else processors.ByteLevel(trim_offsets=False))
    return hf


def sentencepiece_to_hf(tok, add_bos: bool):
    """A sentencepiece model as an HF tokenizers.Tokenizer: the same pieces (BPE with merges recovered from the
    piece order, or unigram with its scores), byte fallback, normalisation rules and dummy prefix; None (with a
    line saying why) for a model type tokenizers has no equivalent of."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    try:
        from sentencepiece import sentencepiece_model_pb2  # needs protobuf (tensorboard depends on it)

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(tok.path.read_bytes())
    except Exception as e:  # noqa: BLE001 - protobuf missing or too old/new for the bundled proto module
        logger.warning(f"export: cannot read {tok.path} as a sentencepiece proto ({type(e).__name__}: {e}): no HF "
                       f"tokenizer files; config.json and generation_config.json carry its ids")
        return None
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = [(p.piece, p.score) for p in proto.pieces]
    normal = 1  # ModelProto.SentencePiece.Type: NORMAL=1, UNKNOWN=2, CONTROL=3, USER_DEFINED=4, BYTE=6
    if spec.model_type == 1:  # unigram
        model = models.Unigram(pieces, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    elif spec.model_type == 2:  # BPE: a piece's id is its merge's rank
        vocab = {p: i for i, (p, _) in enumerate(pieces)}
        merges = []
        for piece in (p.piece for p in proto.pieces if p.type == normal):
            pairs = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
            merges += sorted(pairs, key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
        model = models.BPE(vocab, merges, unk_token=pieces[spec.unk_id][0], fuse_unk=True,
                           byte_fallback=spec.byte_fallback)
    else:
        logger.warning(f"export: {tok.path} is a sentencepiece model of type {spec.model_type} (not BPE or unigram): "
                       f"no HF tokenizer files; config.json and generation_config.json carry its ids")
        return None
    hf = Tokenizer(model)
    # sentencepiece's normaliser: its character map, then (remove_extra_whitespaces) spaces trimmed and runs of
    # them collapsed, then the dummy prefix, then spaces spelt "▁". The prefix goes in here, not in Metaspace's
    # prepend_scheme, which skips it when the text already starts with a space.
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    steps += [normalizers.Prepend("▁")] if norm.add_dummy_prefix else []
    hf.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    # Unigram segments each word on its own (split_by_whitespace); BPE merges never cross a "▁" it has no piece for.
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=spec.model_type == 1)
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()] +
                                   ([decoders.Strip(content=" ", left=1)] if norm.add_dummy_prefix else []))
    hf.add_tokens([AddedToken(p.piece, special=p.type != 4, normalized=False)
                   for p in proto.pieces if p.type in (2, 3, 4)])  # unknown, control, user-defined: never split
    # data.vocab_extra_ids' T5 sentinels, appended after the pieces in id order: the ids come out the run's
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tok.added_tokens])
    if add_bos:
        bos = pieces[tok.bos_id][0]
        hf.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                          special_tokens=[(bos, tok.bos_id)])
    return hf
