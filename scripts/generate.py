"""Generate text from a titanlike run, checkpoint or export, or from a Hugging Face model folder (local files only).

    python scripts/generate.py SOURCE --prompt "def fib(n):" --max-new-tokens 64
    python scripts/generate.py SOURCE --prompt "a" --prompt "b" --temperature 0.8 --top-p 0.95 --seed 0
    python scripts/generate.py SOURCE --prompts-file prompts.txt --max-new-tokens 32 --compile --device cuda
    python scripts/generate.py SOURCE --tokens 1,2,3 --max-new-tokens 8            # ids in, ids out
    python scripts/generate.py SOURCE --chat --prompt "What is 2 + 2?" [--system "Be brief."]   # a chat reply
    python scripts/generate.py LLAVA --image cat.png --prompt "USER: <image>\nWhat is this? ASSISTANT:"
    python scripts/generate.py LLAVA --image a.png --image b.png --tokens 1,63,63,5     # 63: the image token id

SOURCE: a run folder (job.dump_folder/job.run_name), a checkpoint folder, a step folder (any training layout; the
newest complete step unless --step N), a scripts/convert_hf.py import, or an HF folder (titanlike/infer/load.py).
The tokenizer is the run's own (its config.toml) or the HF folder's; without one, give --tokens. A text prompt starts
with the BOS token when the model's documents did (the run's data.add_bos; for an HF folder, when its tokenizer adds
it, as transformers' tokenizer(prompt) does): --bos / --no-bos decide instead. Which step was loaded goes to stderr.
One prompt streams its text as it is generated; several (one per --prompt, or one per line of --prompts-file) run as one
left-padded batch and print in order. Greedy unless --temperature > 0; generation stops at the tokenizer's EOS.

--chat: each prompt is a user turn (after --system's, if given) rendered through the chat template with the
generation prompt, as transformers' apply_chat_template(..., add_generation_prompt=True) renders it (the template
writes any BOS itself); only the assistant's reply is printed, and it ends at the template's end-of-turn text. The
template is the run's (data.chat_template; titanlike/data/chat.py), the HF folder's own, or --chat-template (a
built-in name, a .jinja file or a tokenizer folder).

--image PATH (repeatable; an image-text model such as llava): each placeholder of the prompts takes the next image,
prompt by prompt: "<image>" in a text prompt (also inside a --chat turn), the model's image token id in --tokens. It
becomes the tower's feature count of placeholders (model.args.image_tokens), as HF's llava processor expands it. The
files are read with Pillow, resized to the tower's size and normalised by an HF folder's preprocessor_config.json
(what export writes) or the tower's defaults (mean = std = 0.5, as training normalises); titanlike/infer/images.py.

Bad input (missing or damaged checkpoint, unknown model, a prompt longer than the model's context, bad sampling
values, a missing or unreadable --image file, images that do not match the placeholders, --image for a model
without a vision tower) exits with status 2 and one line naming the problem and the fix; --debug shows the traceback.
"""
from __future__ import annotations

import argparse
import sys

DTYPES = ("float32", "bfloat16", "float16")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every other error of this script (argparse prints usage too)
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="a text file, one prompt per non-empty line")
    p.add_argument("--tokens", action="append", default=[], help="a prompt as token ids, e.g. 1,2,3 (repeatable)")
    p.add_argument("--image", action="append", default=[], help="an image file for the prompts' next <image> "
                   "placeholder (repeatable; image-text models such as llava)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = all)")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (pays off on GPUs)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--step", type=int, default=None, help="the checkpoint step to load (default: the newest)")
    bos = p.add_mutually_exclusive_group()
    bos.add_argument("--bos", dest="bos", action="store_true", default=None,
                     help="start text prompts with the BOS token (default: as the run's data.add_bos)")
    bos.add_argument("--no-bos", dest="bos", action="store_false", help="do not start text prompts with BOS")
    p.add_argument("--chat", action="store_true", help="prompts are user turns of a chat; print the reply")
    p.add_argument("--system", default=None, help="--chat: a system message before each prompt")
    p.add_argument("--chat-template", default=None, help="--chat: a built-in name, .jinja file or tokenizer folder "
                   "instead of the run's template")
    p.add_argument("--speculative", choices=("mtp",), default=None, help="mtp: draft with the model's multi-token-"
                   "prediction modules, verify with one main forward (greedy; titanlike/infer/speculative.py)")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return p.parse_args(argv)


def _check(a: argparse.Namespace) -> None:
    """Sampling values and prompt sources, before anything is loaded."""
    if a.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={a.max_new_tokens} must be at least 1")
    if not a.temperature >= 0:
        raise ValueError(f"--temperature={a.temperature} must be >= 0 (0 = greedy)")
    if a.top_k < 0:
        raise ValueError(f"--top-k={a.top_k} must be >= 0 (0 = no cut)")
    if not 0 < a.top_p <= 1:
        raise ValueError(f"--top-p={a.top_p} must lie in (0, 1] (1 = no cut)")
    if (a.prompt or a.prompts_file) and a.tokens:
        raise ValueError("give text prompts (--prompt / --prompts-file) or --tokens, not both")
    if not (a.prompt or a.prompts_file or a.tokens):
        raise ValueError("nothing to generate from: give --prompt TEXT, --prompts-file FILE or --tokens 1,2,3")
    if a.chat and (a.tokens or a.bos is not None):
        raise ValueError("--chat renders text prompts through the chat template, which writes any BOS itself: drop "
                         "--tokens / --bos / --no-bos")
    if (a.system is not None or a.chat_template) and not a.chat:
        raise ValueError("--system and --chat-template apply to chat prompts: add --chat")


def _token_prompts(specs: list[str], vocab_size: int) -> list[list[int]]:
    out = []
    for spec in specs:
        try:
            ids = [int(x) for x in spec.replace(" ", ",").split(",") if x]
        except ValueError:
            raise ValueError(f"--tokens {spec!r}: give comma-separated integer token ids, e.g. --tokens 1,2,3") \
                from None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if not ids or bad:
            raise ValueError(f"--tokens {spec!r}: ids must lie in 0..{vocab_size - 1} (the model's vocabulary)"
                             + (f"; {bad[:3]} do not" if bad else ""))
        out.append(ids)
    return out


def _text_prompts(a: argparse.Namespace) -> list[str]:
    texts = list(a.prompt)
    if a.prompts_file:
        with open(a.prompts_file) as f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
        if not texts:
            raise ValueError(f"--prompts-file {a.prompts_file} holds no prompt (one per non-empty line)")
    return texts


class _Stream:
    """Prints one row's new text as tokens arrive; bytes of an unfinished UTF-8 character wait for the rest."""

    def __init__(self, tok) -> None:
        self.tok, self.ids, self.shown = tok, [], 0

    def __call__(self, row: int, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids) if self.tok is not None else " ".join(map(str, self.ids)) + " "
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[self.shown:])
        sys.stdout.flush()
        self.shown = len(text)


class _ChatStream(_Stream):
    """A reply as it is generated, up to the end-of-turn text: text that may begin it waits until it is clear. (The
    token stop sequence misses an end of turn whose first tokens merged with the reply's last characters, as a
    byte-level BPE without the template's tokens does: the text is the reference.)"""

    def __init__(self, tok, eot: str) -> None:
        super().__init__(tok)
        self.eot, self.ended = eot, False

    def __call__(self, row: int, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if self.ended or text.endswith("\ufffd"):
            return
        if self.eot and self.eot in text:
            text, self.ended = text[:text.index(self.eot)], True
        elif self.eot:
            text = text[:len(text) - max([n for n in range(1, len(self.eot)) if text.endswith(self.eot[:n])] + [0])]
        sys.stdout.write(text[self.shown:])
        sys.stdout.flush()
        self.shown = max(self.shown, len(text))


def _reply(text: str, eot: str) -> str:
    return text[:text.index(eot)] if eot and eot in text else text


def _chat_prompts(a: argparse.Namespace, loaded, texts: list[str]) -> tuple[list[list[int]], list[list[int]], str]:
    """(each prompt as a rendered user turn with the generation prompt, the end-of-turn token sequence to stop at,
    its text)."""
    import dataclasses

    from titanlike.config.sections import Data
    from titanlike.data.chat import end_of_turn, load_chat_template

    data = loaded.data if loaded.data is not None else Data()
    if a.chat_template:
        data = dataclasses.replace(data, chat_template=a.chat_template)
    template = load_chat_template(data, loaded.tokenizer, key="--chat-template")
    system = [{"role": "system", "content": a.system}] if a.system is not None else []
    prompts = [_encode_pieces(lambda piece, first: loaded.tokenizer.encode_with_offsets(piece)[0], loaded,
                              template.render(system + [{"role": "user", "content": t}], add_generation_prompt=True))
               for t in texts]
    eot = end_of_turn(template).strip()
    return prompts, ([loaded.tokenizer.encode_with_offsets(eot)[0]] if eot else []), eot


def _encode_pieces(encode, loaded, text: str) -> list[int]:
    """A text prompt's ids, each <image> in it as one image token (an image-text model; other models: as text).
    The pieces around the placeholders are encoded separately, BOS (if any) on the first only."""
    from titanlike.infer.images import join_pieces, split_text, takes_images

    if not takes_images(loaded.args):
        return encode(text, True)
    return join_pieces([encode(piece, i == 0) for i, piece in enumerate(split_text(text))], loaded.args.image_token)


def _with_images(a: argparse.Namespace, loaded, prompts: list[list[int]]):
    """(prompts with each image placeholder expanded to the tower's features, the images' pixels or None)."""
    from titanlike.infer.images import expand_placeholders, image_prep, load_pixels, takes_images

    if not a.image and not takes_images(loaded.args):
        return prompts, None
    prep = image_prep(loaded)  # refuses --image on a model without a tower
    pixels = load_pixels(a.image, prep) if a.image else None
    return expand_placeholders(prompts, loaded.args.image_token, loaded.args.image_tokens, len(a.image)), pixels


def _what(loaded) -> str:
    """Which weights were read: the step and its folder, or the HF folder."""
    if loaded.step is None:
        return f"the Hugging Face model in {loaded.source}"
    return f"step {loaded.step} from {loaded.source}"


def run(a: argparse.Namespace) -> int:
    import torch

    from titanlike.infer import generate, load_for_inference

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    texts = [] if a.tokens else _text_prompts(a)
    loaded = load_for_inference(a.source, device=device, dtype=dtype, step=a.step)
    tok, stop, eot = loaded.tokenizer, [], ""
    if a.tokens:
        prompts = _token_prompts(a.tokens, loaded.args.vocab_size)
    elif tok is None:
        raise ValueError(f"{loaded.source} comes with no tokenizer: give the prompt as ids with --tokens 1,2,3")
    elif a.chat:
        prompts, stop, eot = _chat_prompts(a, loaded, texts)
    else:
        prompts = [_encode_pieces(lambda piece, first: loaded.encode(piece, bos=a.bos if first else False), loaded, t)
                   for t in texts]
    given = prompts  # as the user wrote them (shown with --tokens), before the image placeholders are expanded
    prompts, pixels = _with_images(a, loaded, prompts)
    for i, p in enumerate(prompts):
        if len(p) + a.max_new_tokens > loaded.max_seq_len:
            raise ValueError(f"prompt {i + 1} is {len(p)} tokens; with --max-new-tokens={a.max_new_tokens} that "
                             f"exceeds the model's context of {loaded.max_seq_len} tokens: shorten the prompt or "
                             f"lower --max-new-tokens")
    if a.speculative:  # the same tokens as greedy generate; prints the acceptance rate to stderr
        from titanlike.infer.speculative import for_script

        generate = for_script(a.speculative, loaded.model, a.temperature, a.compile,
                              lambda line: print(line, file=sys.stderr))
    print(f"loaded {_what(loaded)}", file=sys.stderr)  # stderr: stdout holds only the text
    kw = dict(max_new_tokens=a.max_new_tokens, eos_id=loaded.stop_ids or None, stop=stop or None,
              temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed, compile=a.compile,
              spec=loaded.spec, pixels=pixels)
    if len(prompts) == 1:
        if not a.chat:  # a chat prints the reply alone
            sys.stdout.write(texts[0] if texts else " ".join(map(str, given[0])) + " -> ")
        stream = _ChatStream(tok, eot) if a.chat else _Stream(tok if texts else None)
        generate(loaded.model, prompts, on_token=stream, **kw)
        sys.stdout.write("\n")
        return 0
    for i, (prompt, new) in enumerate(zip(given, generate(loaded.model, prompts, **kw))):
        shown = ((_reply(tok.decode(new), eot) if a.chat else texts[i] + tok.decode(new)) if texts else
                 f"{' '.join(map(str, prompt))} -> {' '.join(map(str, new))}")
        sys.stdout.write(f"{'' if i == 0 else chr(10)}=== prompt {i + 1}\n{shown}\n")
    return 0


def main(argv: list[str]) -> int:
    a = _args(argv)
    from titanlike.checkpoint.layout import CheckpointError

    try:
        _check(a)
        return run(a)
    except (CheckpointError, ValueError, OSError) as e:
        if isinstance(e, BrokenPipeError):  # stdout's reader went away (`| head`): nothing to report
            raise
        if a.debug:  # the traceback, and still status 2
            from titanlike.cli import debug_traceback

            debug_traceback(e)
            return 2
        msg = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.filename and e.strerror else str(e)
        print("error: " + " ".join(line.strip() for line in msg.splitlines() if line.strip()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    from titanlike.cli import run_main

    sys.exit(run_main(main))
