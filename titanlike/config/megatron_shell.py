"""A Megatron-LM launch script -> the flags given to its pretrain script (titanlike/config/megatron.py translates them).

Users paste whole scripts: variables set earlier (`TP=8`, `GPT_ARGS="--num-layers 24 ..."`, arrays `ARGS=(...)`)
and used later (`$TP`, `${ARGS[@]}`), `$(scontrol ... | head -n 1)`, pipes, redirects, comments, SLURM headers and
other commands (`python tools/preprocess_data.py ...`) around the launch. This reads just enough shell to find the
launch and expand what the script itself defines; a variable it never sets stays `$NAME` (the translator lists it).
No command is run; a `# comment` inside a multi-line "..." flag list is read as a comment, as it is meant.
What counts as the launch, in order:
  1. the command running a `pretrain*.py` script (else another `*train*.py` one, not tools/preprocess_data.py):
     the flags after the script;
  2. else lines that start with a --flag (a bare flag block): all of them, in order;
  3. else variables holding --flags that the script sets but never uses (a block of `MODEL_ARGS="..."`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field



class MegatronError(ValueError):
    """A flag block that cannot be read or that contradicts itself (a flag without its value, --fp16 with --bf16)."""


@dataclass
class Launch:
    flags: list[str]  # the words after the script (Megatron's flags and their values), variables expanded
    launcher: list[str] = field(default_factory=list)  # the words before it: torchrun/srun/python and their options
    script: str = ""  # pretrain_gpt.py, or "" for a bare flag block
    line: int = 0  # where the launch starts (1-based), 0 for a bare block


_NAME = re.compile(r"[A-Za-z_]\w*")
_ASSIGN = re.compile(r"([A-Za-z_]\w*)(\+?)=")
_KEYWORDS = {"do", "then", "else", "elif", "if", "while", "until", "time", "!", "{", "exec", "nohup", "eval"}
_DECLARE = {"export", "declare", "local", "readonly", "typeset"}


class _Lexer:
    """Shell text -> commands; a command is (line, words); a word is a list of parts ("lit", text) /
    ("var", name, quoted, all_items) / ("arr", [words]) (an array assignment's items)."""

    def __init__(self, text: str) -> None:
        self.s, self.i, self.line = text, 0, 1
        self.commands: list[tuple[int, list[list[tuple]]]] = []

    def run(self) -> list[tuple[int, list[list[tuple]]]]:
        words, start = self._words(stop="")
        if words:
            self.commands.append((start, words))
        return self.commands

    def _peek(self, k: int = 0) -> str:
        return self.s[self.i + k] if self.i + k < len(self.s) else ""

    def _words(self, stop: str) -> tuple[list[list[tuple]], int]:
        """Words up to `stop` (")" inside an array) or the end; at top level, command ends start new commands."""
        words: list[list[tuple]] = []
        word: list[tuple] | None = None
        start = self.line
        while self.i < len(self.s):
            c = self._peek()
            if c == "\\" and self._continuation():
                continue
            if stop and c == stop:
                self.i += 1
                break
            if c in " \t\r" or (c == "\n" and stop):
                self.line += c == "\n"
                self.i += 1
                word = self._end(words, word)
                continue
            if c == "#" and word is None:  # a comment (also #!/bin/bash and #SBATCH lines)
                while self.i < len(self.s) and self._peek() != "\n":
                    self.i += 1
                continue
            if c in ";|&()" and stop:  # inside NAME=( ... ): not an array item
                self.i += 1
                word = self._end(words, word)
                continue
            if c in "\n;|&()":
                self._end(words, word)
                self.line += c == "\n"
                self.i += 1
                if words:
                    self.commands.append((start, words))
                words, word, start = [], None, self.line
                continue
            if c in "<>":  # a redirect: drop it, its fd number (2>&1) and its target
                if word is not None and all(p[0] == "lit" and p[1].isdigit() for p in word):
                    word = None
                self.i += 1
                while self._peek() in "<>&":
                    self.i += 1
                while self._peek() in " \t":
                    self.i += 1
                self._word_parts()  # the target (a file name or an fd)
                continue
            if word is None:
                word = []
                if not stop and c != "$" and self._array_assignment(word):
                    words.append(word)
                    word = None
                    continue
            word.extend(self._word_parts(single=True))
        if word is not None:
            words.append(word)
        return words, start

    def _continuation(self) -> bool:
        """A backslash ending the line, also `--bf16 \\   # comment` (docs write it; bash would pass " ")."""
        m = re.compile(r"\\[ \t]*(#[^\n]*)?\n").match(self.s, self.i)
        if not m or (m.end() - self.i > 2 and self.s[self.i + 1] not in " \t"):
            return False
        self.i = m.end()
        self.line += 1
        return True

    def _end(self, words: list, word: list | None) -> None:
        if word is not None:
            words.append(word)
        return None

    def _array_assignment(self, word: list) -> bool:
        """NAME=( ... ): read the items as words; the word becomes [("lit", "NAME="), ("arr", items)]."""
        m = _ASSIGN.match(self.s, self.i)
        if not m or self.s[m.end():m.end() + 1] != "(":
            return False
        self.i = m.end() + 1
        items, _ = self._words(stop=")")
        word.extend([("lit", m.group(0)), ("arr", items)])
        return True

    def _word_parts(self, single: bool = False) -> list[tuple]:
        """One word's parts (or, with single, the next piece of it: up to a quote change or an expansion)."""
        parts: list[tuple] = []
        while self.i < len(self.s):
            c = self._peek()
            if c in " \t\r\n;|&()<>":
                break
            if c == "\\":
                if self._continuation():
                    continue
                parts.append(("lit", self._peek(1)))
                self.i += 2
            elif c == "'":
                end = self.s.find("'", self.i + 1)
                end = len(self.s) if end < 0 else end
                parts.append(("lit", self.s[self.i + 1:end]))
                self.line += self.s.count("\n", self.i, end)
                self.i = end + 1
            elif c == '"':
                self.i += 1
                parts.extend(self._double_quoted())
            elif c == "$" or c == "`":
                parts.append(self._dollar(quoted=False))
            else:
                parts.append(("lit", c))
                self.i += 1
            if single:
                break
        return parts

    def _double_quoted(self) -> list[tuple]:
        parts: list[tuple] = []
        while self.i < len(self.s) and self._peek() != '"':
            c = self._peek()
            if c == "\\" and self._peek(1) in '"\\$`\n':
                if self._peek(1) != "\n":
                    parts.append(("lit", self._peek(1)))
                self.line += self._peek(1) == "\n"
                self.i += 2
            elif c in "$`":
                parts.append(self._dollar(quoted=True))
            elif c == "#" and self.s[self.i - 1] in " \t" and "\n" in self.s[self.i:self.s.find('"', self.i)]:
                # `--bf16  # or --fp16` in a multi-line "..." flag list: bash would pass the words on, its writer
                # meant a comment (Megatron has no flag "#")
                while self._peek() not in ("\n", ""):
                    self.i += 1
            else:
                self.line += c == "\n"
                parts.append(("lit", c))
                self.i += 1
        self.i += 1
        return parts

    def _dollar(self, quoted: bool) -> tuple:
        """$NAME, ${NAME}, ${NAME[@]}, ${NAME:-default}; $(...), $((...)) and `...` are unknown (never run)."""
        s, i = self.s, self.i
        if s[i] == "`" or s.startswith("$(", i):
            depth, j = 0, i + (1 if s[i] == "`" else 0)
            if s[i] == "`":
                j = s.find("`", i + 1)
                j = len(s) if j < 0 else j + 1
            else:
                while j < len(s):
                    depth += (s[j] == "(") - (s[j] == ")")
                    j += 1
                    if depth == 0 and s[j - 1] == ")":
                        break
            self.line += s.count("\n", i, j)
            self.i = j
            return ("lit", s[i:j])  # kept as text: a value the script computes at run time
        if s.startswith("${", i):
            j = s.find("}", i)
            j = len(s) if j < 0 else j
            body, self.i = s[i + 2:j], j + 1
            m = _NAME.match(body)
            if not m:
                return ("lit", s[i:self.i])
            rest = body[m.end():]
            default = rest[2:] if rest.startswith(":-") or rest.startswith(":=") else None
            return ("var", m.group(0), quoted, rest in ("[@]", "[*]"), default, s[i:self.i])
        m = _NAME.match(s, i + 1)
        if m:
            self.i = m.end()
            return ("var", m.group(0), quoted, False, None, s[i:self.i])
        self.i += 2 if i + 1 < len(s) and s[i + 1] in "@*#?$!0123456789-" else 1
        return ("lit", s[i:self.i])


def _expand(word: list[tuple], env: dict) -> list[str]:
    """A word -> its fields: unquoted variables split on whitespace, arrays give one field per item; a variable the
    script never set stays as written ($NAME), for the translator to list."""
    fields, cur, started = [], "", False
    for part in word:
        if part[0] == "lit":
            cur, started = cur + part[1], True
            continue
        if part[0] == "arr":
            continue
        _, name, quoted, all_items, default, raw = part
        value = env.get(name)
        if value is None and default is not None:
            value = default
        if value is None:
            cur, started = cur + raw, True
            continue
        items = value if isinstance(value, list) else [value]
        if not all_items:
            items = items[:1]
        pieces: list[str] = []
        for item in items:
            pieces.extend([item] if quoted else item.split())
        if not pieces:
            continue
        cur += pieces[0]
        if len(pieces) > 1:
            fields.append(cur)
            fields.extend(pieces[1:-1])
            cur = pieces[-1]
        started = True
    if started and (cur or any(p[0] == "lit" for p in word)):
        fields.append(cur)
    return fields


def read_launch(text: str) -> Launch:
    """The launch in a script or flag block (see the module's docstring), with the script's own variables expanded."""
    env: dict[str, object] = {}
    launches: list[Launch] = []
    bare: list[str] = []
    flag_vars: dict[str, str] = {}  # variables holding --flags, for a script that only sets them
    used: set[str] = set()
    for line, words in _Lexer(text).run():
        while words and _plain(words[0]) in _KEYWORDS:
            words = words[1:]
        if words and _plain(words[0]) in _DECLARE:
            words = [w for w in words[1:] if not _plain(w).startswith("-")]
        assigns = 0
        for w in words:
            m = _ASSIGN.match(_plain(w, prefix=True))
            if not m:
                break
            assigns += 1
            used.update(p[1] for p in w if p[0] == "var")
            if any(p[0] == "arr" for p in w):
                items = [f for item in next(p[1] for p in w if p[0] == "arr") for f in _expand(item, env)]
                env[m.group(1)] = (list(env.get(m.group(1)) or []) if m.group(2) else []) + items
            else:
                value = " ".join(_expand(_strip_prefix(w, len(m.group(0))), env))
                env[m.group(1)] = (str(env.get(m.group(1), "")) if m.group(2) else "") + value
            if (_as_fields(env[m.group(1)]) or [""])[0].startswith("--"):
                flag_vars[m.group(1)] = m.group(1)
        command = words[assigns:]
        if not command:
            continue
        for w in command:
            used.update(p[1] for p in w if p[0] == "var")
        fields = [f for w in command for f in _expand(w, env)]
        scripts = [i for i, f in enumerate(fields) if f.endswith(".py") and (i == 0 or fields[i - 1] != "-m")]
        if scripts:
            i = scripts[0]
            launches.append(Launch(fields[i + 1:], fields[:i], fields[i], line))
        elif fields and fields[0].startswith("--") and len(fields[0]) > 2:
            bare.extend(fields)
    pretrain = [x for x in launches if x.script.rsplit("/", 1)[-1].startswith("pretrain")]
    chosen = pretrain or [x for x in launches if "train" in x.script.rsplit("/", 1)[-1]]
    if len(chosen) > 1:
        lines = ", ".join(str(x.line) for x in chosen)
        raise MegatronError(f"the script launches {chosen[0].script} {len(chosen)} times (lines {lines}): "
                            f"keep the one to translate")
    if chosen:
        return chosen[0]
    if bare:
        return Launch(bare)
    leftover = [f for name in flag_vars if name not in used for f in _as_fields(env[name])]
    if leftover:
        return Launch(leftover)
    raise MegatronError("no pretrain_gpt.py launch and no --flags found: give the launch script (or its flags, "
                        "e.g. --num-layers 24 --hidden-size 1024 ...)")


def _as_fields(value: object) -> list[str]:
    return [f for item in (value if isinstance(value, list) else [value]) for f in str(item).split()]


def _plain(word: list[tuple], prefix: bool = False) -> str:
    """A word's literal text (its leading literal text with prefix=True; "" if it starts with an expansion)."""
    out = ""
    for p in word:
        if p[0] != "lit":
            if prefix:
                break
            return ""
        out += p[1]
    return out


def _strip_prefix(word: list[tuple], n: int) -> list[tuple]:
    """The word without its first n literal characters (NAME= of an assignment)."""
    out, skip = [], n
    for p in word:
        if skip and p[0] == "lit":
            take = min(skip, len(p[1]))
            skip -= take
            if p[1][take:]:
                out.append(("lit", p[1][take:]))
            continue
        out.append(p)
    return out or [("lit", "")]
