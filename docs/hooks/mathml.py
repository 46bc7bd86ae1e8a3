"""MkDocs hook: typeset the site's TeX as MathML when it is built.

`pymdownx.arithmatex` (generic mode) leaves every equation of the pages and of the docstrings
that mkdocstrings renders as `<span class="arithmatex">\\(...\\)</span>` or
`<div class="arithmatex">\\[...\\]</div>`. This hook converts each one with the pure-Python
`latex2mathml` (the `docs` extra) into MathML, which browsers draw natively: the built site
shows its equations with no JavaScript and no network, at build time or when read.

latex2mathml targets full MathML; browsers implement MathML Core, so the tree is adjusted:
styled letters (`\\mathbb`, `\\mathcal`, `\\mathbf`) become their Unicode mathematical
characters, table alignment and spacing become CSS, named spaces become lengths. A few TeX
forms it lacks are rewritten first (`REWRITES`). An equation that cannot be converted, or
that keeps a TeX command in its output (a command latex2mathml does not know), is a warning,
so `mkdocs build --strict` fails and names it.
"""

from __future__ import annotations

import functools
import html
import logging
import re
import unicodedata
from xml.etree.ElementTree import Element, SubElement, tostring

from latex2mathml.converter import convert_to_element
from latex2mathml.symbols_parser import convert_symbol

log = logging.getLogger("mkdocs.hooks.mathml")

#: arithmatex's generic output: the TeX, HTML-escaped, with its \( \) or \[ \] delimiters.
ARITHMATEX = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.DOTALL)
#: Inline math in a table-of-contents title (toc keeps a heading's text, not its HTML).
INLINE = re.compile(r"\\\((.+?)\\\)", re.DOTALL)

#: TeX that latex2mathml lacks, as TeX it knows.
REWRITES = [
    (re.compile(r"\\arg(?![A-Za-z])"), r"\\operatorname{arg}"),
    (re.compile(r"(?<!\\)~"), r"\\ "),  # a tie, which latex2mathml reads as \sim
    (re.compile(r"\\(begin|end)\{aligned\}"), r"\\\1{split}"),  # the same layout
    # A backslash ending a line is a control space (but `\\` ending a line is a new row).
    (re.compile(r"(?<!\\)((?:\\\\)*)\\\n"), r"\1\\ "),
    # Math inside text, `\text{$T$ steps}`: text, math, text.
    (
        re.compile(r"\\text\{([^{}]*\$[^{}]*)\}"),
        lambda m: "".join(
            part if i % 2 else rf"\text{{{part}}}"
            for i, part in enumerate(re.split(r"(?<!\\)\$", m.group(1)))
            if part
        ),
    ),
]
#: Text-mode escapes (`\text{num\_steps}`) that latex2mathml copies into <mtext> verbatim.
TEXT_ESCAPE = re.compile(r"\\([_&%$#{}])")
#: TeX left in the output: a command, or math in text that was not converted.
LEFTOVER = re.compile(r"\\|\$[^$]+\$")
#: Token text that is still one TeX command, e.g. `\lVert` after `\bigl`.
COMMAND = re.compile(r"\\(?:[A-Za-z]+|.)")
#: MathML's named spaces, which MathML Core (what browsers implement) does not have.
NAMED_SPACES = {
    "veryverythinmathspace": 1 / 18,
    "verythinmathspace": 2 / 18,
    "thinmathspace": 3 / 18,
    "mediummathspace": 4 / 18,
    "thickmathspace": 5 / 18,
    "verythickmathspace": 6 / 18,
    "veryverythickmathspace": 7 / 18,
}
#: mathvariant -> the style word of Unicode's mathematical alphanumeric characters. Browsers
#: honour only mathvariant="normal", so other variants become those characters.
VARIANTS = {
    "bold": "BOLD",
    "italic": "ITALIC",
    "bold-italic": "BOLD ITALIC",
    "double-struck": "DOUBLE-STRUCK",
    "script": "SCRIPT",
    "bold-script": "BOLD SCRIPT",
    "fraktur": "FRAKTUR",
    "bold-fraktur": "BOLD FRAKTUR",
    "sans-serif": "SANS-SERIF",
    "bold-sans-serif": "SANS-SERIF BOLD",
    "sans-serif-italic": "SANS-SERIF ITALIC",
    "sans-serif-bold-italic": "SANS-SERIF BOLD ITALIC",
    "monospace": "MONOSPACE",
}
#: Letters whose styled form predates the mathematical block (ℝ, ℬ, ℭ, ℎ, ...).
LETTERLIKE = {"FRAKTUR": "BLACK-LETTER", "ITALIC SMALL H": "PLANCK CONSTANT"}
LETTER = re.compile(r"(?:LATIN|GREEK) (CAPITAL|SMALL) LETTER (\w+)|DIGIT (\w+)")
#: Signs that TeX sets as unary (no space around) after an operator, relation, opening
#: fence or punctuation, and at the start: browsers only do the start.
SIGNS = {"\u2212", "+", "\u00b1", "\u2213"}
#: Operators after which a sign stays binary (closing fences; TeX's ordinary bars).
CLOSING = {")", "]", "}", "\u27e9", "\u230b", "\u2309", "|", "\u2016", "!", "\u2032"}
#: Delimiters, which TeX draws at their natural size unless \left, \right or \big say so
#: (browsers stretch them by default), and bars, which TeX spaces as ordinary symbols.
FENCES = {"(", ")", "[", "]", "{", "}", "\u27e8", "\u27e9", "\u230a", "\u230b", "\u2308", "\u2309"}
BARS = {"|", "\u2016"}
#: A function name's text (latex2mathml writes \log as <mi>log</mi>, \max as <mo>max</mo>).
WORD = re.compile(r"[^\W\d_]\w+")
#: Function names whose subscript goes below them in display math, as TeX's \max_i.
LIMITS = {"lim", "liminf", "limsup", "max", "min", "sup", "inf", "det", "gcd", "Pr"}
#: Symbols that TeX sets as ordinary ones (latex2mathml writes some as operators) and the
#: categories of Unicode characters that are operators otherwise.
ORDINARY = {"\u221e", "\u2202", "\u2207", "\u00ac"}
SYMBOLS = {"Sm", "Po", "Ps", "Pe"}
PRIMES = {"\u2032", "\u2033", "\u2034"}
#: Scripted elements whose first child is their base (an embellished operator's core).
SCRIPTED = {"msub", "msup", "msubsup", "munder", "mover", "munderover"}
THIN = "0.1667em"


class MathError(ValueError):
    pass


def styled(char: str, style: str) -> str | None:
    """`char` in a Unicode mathematical style ("DOUBLE-STRUCK", ...), None if it has none."""
    match = LETTER.fullmatch(unicodedata.name(char, ""))
    if match is None:
        return None
    case, letter, digit = match.groups()
    glyph = f"DIGIT {digit}" if digit else f"{case} {letter}"
    names = [
        f"MATHEMATICAL {style} {glyph}",
        f"{LETTERLIKE.get(style, style)} {glyph}",
        LETTERLIKE.get(f"{style} {glyph}", ""),
    ]
    for name in names:
        try:
            return unicodedata.lookup(name)
        except KeyError:
            pass
    return None


def core(element: Element) -> None:
    """Adjust latex2mathml's tree, in place, to what browsers (MathML Core) draw."""
    for node in element.iter():
        if node.text:
            node.text = html.unescape(node.text)  # latex2mathml writes "&#x003B2;" as text
            if node.tag == "mtext":
                node.text = TEXT_ESCAPE.sub(r"\1", node.text)
            elif COMMAND.fullmatch(node.text):  # e.g. <mo>\lVert</mo> after \bigl
                code = convert_symbol(node.text)
                if code:
                    node.text = chr(int(code, 16))
            if node.tag == "mi" and len(node.text) == 1:
                if node.text == "~":  # \sim
                    node.text = "\u223c"
                symbol = unicodedata.category(node.text) in SYMBOLS
                if symbol and node.text not in ORDINARY | PRIMES:
                    node.tag = "mo"  # \sim, \pm, \succeq, \langle, :, ; as operators
                elif "\u0391" <= node.text <= "\u03a9":
                    node.set("mathvariant", "normal")  # TeX's capital Greek is upright
    for node in list(element.iter()):
        variant = node.get("mathvariant")
        if variant == "monospace" and node.tag == "mtext":  # \texttt: the site's code font
            node.set("style", "font-family: var(--md-code-font-family, monospace)")
            del node.attrib["mathvariant"]
        elif variant in VARIANTS and node.text:
            chars = [styled(c, VARIANTS[variant]) for c in node.text]
            if all(chars):
                node.text = "".join(chars)
                del node.attrib["mathvariant"]
        width = node.get("width", "")
        if node.tag == "mspace" and width.removeprefix("negative") in NAMED_SPACES:
            em = NAMED_SPACES[width.removeprefix("negative")]
            node.set("width", f"{-em if width.startswith('negative') else em:.4f}em")
        scripted = node.tag in SCRIPTED and len(node) > 1
        if node.tag in ("msup", "msubsup") and scripted and set(node[-1].text or "x") <= PRIMES:
            # x' and x_i' as x′ and (x′)_i: the prime glyph is a raised one already, and
            # browsers draw it as a dot in a superscript.
            prime = node[-1]
            prime.tag = "mo"
            prime.attrib.update(lspace="0", rspace="0")
            if node.tag == "msup":
                node.tag = "mrow"
            else:
                base = node[0]
                node.remove(base)
                node.remove(prime)
                node.insert(0, Element("mrow"))
                node[0].extend([base, prime])
                node.tag = "msub"
        if node.tag == "mo" and "minsize" in node.attrib:  # \big and friends
            node.set("stretchy", "true")
        if scripted and node[0].tag == "mo" and "minsize" in node[0].attrib:
            base = node[0]  # \Big|_{x=0}: browsers size a script's base only in an <mrow>
            node.remove(base)
            node.insert(0, Element("mrow"))
            node[0].append(base)
        for i, child in enumerate(node):  # \operatorname{stop\_gradient}: <mo/><mrow>letters
            if child.tag == "mo" and not child.text and not len(child) and i + 1 < len(node):
                letters = node[i + 1]
                if letters.tag == "mrow" and all(not len(c) and c.text for c in letters):
                    child.text = "".join(TEXT_ESCAPE.sub(r"\1", c.text) for c in letters)
                    node.remove(letters)
        limits = scripted and is_function(node[0]) and node[0].text in LIMITS
        if node.tag in ("msub", "msubsup") and limits:
            node.tag = {"msub": "munder", "msubsup": "munderover"}[node.tag]
            node[0].set("movablelimits", "true")  # below in display, a subscript inline
        if node.tag == "mo" and node.text in ORDINARY:
            node.tag = "mi"
        if node.tag == "mo" and node.text in ("/", ".") and not node.attrib:  # TeX's ordinary
            node.attrib.update(lspace="0", rspace="0")
        if node.tag == "mo" and node.text in FENCES | BARS:
            if "stretchy" not in node.attrib and "minsize" not in node.attrib:
                node.set("stretchy", "false")
            if node.text in BARS and "form" not in node.attrib:
                node.set("lspace", "0")
                node.set("rspace", "0")
        spacing_in_row(node)
        if node.tag == "mtable":  # column alignment and spacing, as CSS
            spacing = node.get("columnspacing")
            for cell in (cell for row in node for cell in row if cell.tag == "mtd"):
                style = []
                if cell.get("columnalign") in ("left", "right"):
                    style.append(f"text-align: {cell.attrib.pop('columnalign')}")
                if spacing is not None:
                    style.append(f"padding-left: 0; padding-right: {spacing}")
                if style:
                    cell.set("style", "; ".join(style))


def is_function(node: Element | None) -> bool:
    """A function name (log, max, Tr): latex2mathml's <mi> or <mo> of a word."""
    return node is not None and node.tag in ("mi", "mo") and bool(WORD.fullmatch(node.text or ""))


def operator(node: Element | None) -> Element | None:
    """The <mo> that `node` is, or is the base of (max with a subscript), else None."""
    if node is not None and node.tag in SCRIPTED and len(node):
        node = node[0]
    return node if node is not None and node.tag == "mo" else None


def spacing_in_row(row: Element) -> None:
    """TeX's spacing of the children of `row` where browsers' operator dictionary differs:
    a sign after an operator, relation, opening fence or punctuation is unary; a function
    name (log, max, Tr) is an operator with a thin space to ordinary neighbours."""
    children = [child for child in row if child.tag != "mspace"]
    for i, child in enumerate(children):
        previous = children[i - 1] if i else None
        following = children[i + 1] if i + 1 < len(children) else None
        if child.tag == "mo" and child.text in SIGNS and "form" not in child.attrib:
            before = operator(previous)
            if before is not None and before.text not in CLOSING:
                child.set("form", "prefix")
        core = child[0] if child.tag in SCRIPTED and len(child) else child
        if is_function(core):
            core.tag = "mo"
            before = operator(previous)
            after = operator(following)
            ordinary_before = previous is not None and (
                before is None or before.text in CLOSING or is_function(before)
            )
            core.set("lspace", THIN if ordinary_before else "0")
            core.set("rspace", THIN if following is not None and after is None else "0")


def leftover_commands(element: Element) -> list[str]:
    found = []
    for node in element.iter():
        if node.tag != "annotation" and node.text and LEFTOVER.search(node.text):
            found.append(node.text)
        if node.tag == "mo" and not node.text and not len(node) and not node.attrib:
            found.append("<mo/>")  # an operator latex2mathml could not fill (not \left.)
    return found


@functools.cache
def mathml(tex: str, display: str) -> str:
    """The MathML of `tex` (no delimiters), with the TeX kept as its annotation."""
    source = tex
    for pattern, replacement in REWRITES:
        source = pattern.sub(replacement, source)
    try:
        element = convert_to_element(source, display=display)
    except Exception as error:  # latex2mathml raises its own exceptions and plain ones
        raise MathError(f"{type(error).__name__}: {error}") from error
    core(element)
    leftover = leftover_commands(element)
    if leftover:
        raise MathError(f"unknown TeX {leftover}")
    del element.attrib["xmlns"]  # implied in HTML
    body = list(element)
    semantics = SubElement(element, "semantics")
    for child in body:
        element.remove(child)
        semantics.append(child)
    annotation = SubElement(semantics, "annotation", encoding="application/x-tex")
    annotation.text = tex.strip()
    return tostring(element, encoding="unicode")


def typeset(math: str, display: str, where: str) -> str | None:
    """MathML for the TeX `math` with its delimiters; None (and a warning) if it fails."""
    tex = math[2:-2]
    try:
        return mathml(tex, display)
    except MathError as error:
        log.warning(f"{where}: cannot typeset {math!r} as MathML: {error}")
        return None


def on_post_page(output: str, page, config) -> str:
    where = page.file.src_uri

    def replace(match: re.Match) -> str:
        tag, math = match.group(1), html.unescape(match.group(2)).strip()
        display = {"\\(": "inline", "\\[": "block"}.get(math[:2])
        rendered = typeset(math, display, where) if display else None
        if rendered is None:
            if not display:
                log.warning(f"{where}: unexpected arithmatex output {math[:60]!r}")
            return match.group(0)
        return f'<{tag} class="arithmatex">{rendered}</{tag}>'

    return ARITHMATEX.sub(replace, output)


def on_page_content(content: str, page, config, files) -> str:
    """Headings' math in the table of contents, which holds the heading's text."""

    def titles(items):
        for item in items:
            yield item
            yield from titles(item.children)

    def replace(match: re.Match) -> str:
        math = html.unescape(match.group(0))
        return typeset(math, "inline", page.file.src_uri) or match.group(0)

    for item in titles(page.toc):
        item.title = INLINE.sub(replace, item.title)
    return content
