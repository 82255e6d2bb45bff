"""Byte-level BPE as llama.cpp runs it (llama-vocab.cpp ``llm_tokenizer_bpe``, unicode.cpp ``unicode_regex_split``).

Pre-tokenization. llama.cpp does not run its regexes on the text itself: it "collapses" every non-ASCII code point
to one byte standing for its Unicode category (letter, number, punctuation, mark, symbol; whitespace becomes \\v;
anything else 0xD0), rewrites ``\\p{L}`` etc. in the regex as classes of those bytes plus their ASCII members, and
runs std::regex (ECMAScript) over the collapsed text. The regexes of the common families (gpt2, llama3, qwen2,
qwen35) run through hand-written matchers instead, which give the same splits over the same category flags. We do
the same collapse with a lookup table built from llama.cpp's own Unicode data (its version of Unicode, not Python's),
and run Python's ``re`` in ASCII mode (``\\s`` = C-locale isspace) over the collapsed text: exact, and C-speed.

Merging. Words are byte-encoded with GPT-2's byte-to-unicode map and merged by rank, lowest first, leftmost among
equals. HF ``tokenizers``' BPE model does exactly this when every merge result and every byte character is in the
vocabulary (it is built with all tokens, as llama.cpp's ``token_to_id``), so it is the engine; a plain Python merger
(``bpe_merge_word``) covers vocabularies where it is not, and serves the tests as a second opinion.
"""
from __future__ import annotations

import base64
import heapq
import re
import zlib

import numpy as np

# ---------------------------------------------------------------------------------------------- Unicode categories
# llama.cpp's unicode_ranges_flags (src/unicode-data.cpp, generated from UnicodeData.txt): range start deltas
# (uint32) then one category flag byte per range: 1 undefined, 2 number, 4 letter, 8 separator, 0x10 mark,
# 0x20 punctuation, 0x40 symbol, 0x80 control. zlib + base85.
_FLAG_RANGES = (
    "c-pO6O^h8!5#H|U`FZo++nwFD_s7n@9ow5t>|MNTJJ>NlVZu+MC_e-NMnMRI2)~I!BoH9DJmtb6aLO$QBoNAh6W81#1ect+5OF{V"
    "A(31;MI2B_S9g`)_iB4~9YEuGJ=0TNU0wCnPxrcASXeOr&bTeOb^fmXZTTCuXMj%bGwPl0bMTyVYZG)%^`~fLzIAT5xqZXL@gsjP"
    "@;s#)yX@~5lnj>V?UO;T?-aM6<@P0RX|7lKc^7z){w~5?!tVo$uT8AE^7mPmN#q(b&rFSxZz%VkzfZH>a9v*mI@D1Cyigalnr|^-"
    "mkG;CG*5vni#(n%FaRD|V%=+Ci-DrcnP!RKH<e6==Onrfg<Z?fq|Zz6on*QWbF6?)YS2Z^{SDAo@Lgor`pgn|D%CjTr}39587!>D"
    "Ch&tk>yDAlCR(d})F~M=;NjGIYBj$B%%p7DCr_ThKaN9tFDX6N2}~Di{7E+JlOtubGGX7WN1j5x8}Q)_?4BKCSF}UMan7-<nvYfM"
    "Cm$U1`g6Xko_N|M)@~I4GO=c(bR;?`d;G#2BSU?R9r|P`dgQ2;ZAEVylNW&|HIGqtGJpY@YqbY=EBw5n{6XX@)m(+bKm{1GYAuI~"
    "j|15%&?kMrJAp6Bg&V3L^)`U#T+x+k4w}D(^)D&Ai>*#2a){2sBL5Eeol<fP;XC4~P;?H~zXyD3rY#`H>R5w*K4zVxj)eDaPmQz3"
    "&ySn=wUs?<zNp^ME!^2S(eq8!{|Sg4173T^elF|3mGGhG?0nrMwVm*K6yi?Ba;<=Gt%42*{LQld#)%q$`tM`xWIeT)1(~HCCh|_f"
    "HAo3D<h-)aLrlA^;=%}gD1$jC3U~WVcSgx^p5s^!zWPD%r!CO2UQ4O!Fp}*G^EzNVR6I`&xp$DLttPBzk$<1_K*e(J02Xq{*TQ=T"
    "Y*#XlE!evPy`Ki16^VL;_`mM&j&iP<$J(yKUUf`dka}Nqn#wCWHap-iG-H)hjml|QM`FyAxG@IIpug7&tGZ6tb+pKFj{Wx>)HRrQ"
    "bUh(9D^7@^vK9-qLay@JHCUt2{fPHcg4KU>y**@Gf5hKUaQ*Zx8*w#ZtO{;P-j_|J`55E{`u+pPfaHm9`}-ddhcgws%?UB~euaZY"
    "s3!)A8sz=9E&HE=HH_HTWxx9r_r1w|P0v23hVfDh6sq3I5;gj*o_)g?!QMIKn=iw7*}J#w*F&iFwn455_}>!KQ~y2u-uVx&Z$>}<"
    "`K>6!4PL`#o@;F8^NVG_IRIPM%9kGkTG^+qLrnW7w_TzpG~laEPu;ezu#^GT3eGzY_6JuvUsWpStbk9OgkA4~G3)H#Lx}qlj}D+F"
    "Pt_6_PilC-$m0e*dm604)>R(8nyABUk3KhmW|+Wb4e=V=l&|f9Pl{~c1DsjK^VfUPH`bZ<3bzy-pXa#o9gYPh`%$jy(ptso{DiZX"
    "=Qy_#exBty8pfODGXjhSQX^muMb8%!=Od{a#(_*f?KyAyf1JCO9G9{ld*Pn4RQq|v$Vknxs`Mv0YmsB(Phel__^eCn&zr1kjA3JV"
    "K7g~a7r}3?K#hAA@`;1G7WV)-V??kq0ln;izY8s$3;jZ2aR+K8YVYMS_kmvzK?kX`gyX(bZGOW<`PX>fiv3UQe+lx$rxIsB`-ytX"
    "!d}`yJeB>!Hunv9|G295OF7GfvF;3Dw&R?OXGC&ta5<6pa@b$tw=Iwx&;3ehv0fG|v|zitluyan>wxPus4Z9F{9^_7%p-n&(%+A8"
    "Uc1KFyvE-Og&nfju9@Y~OFidmvRB%I*i^AxLy&z9_E3)Tdz$Ay1vxR}`gaNBpCr!m2H=0gL|ut{{7vwEvHK3hvRc(*vW5$)Pvkq~"
    "u}<0ECeFe#sIP}`4!g;ADbySf^z4Jt&uWOH2aqRf$o=p4Owgz^B3+N^bGKaW152pgUt$}sfc@)4E|$IAA?rt<kJkKmhXasl0Qpn)"
    "zK0xlGl)x~i!uAfo~lV?Z+ach_Lsn4aPRaQ$0E`HGaM&YnYL1XQ7L_HC_C%F%NTWzQFGlWeD8tvmx)|>7I1Md&|n^@KsT4wd4JBj"
    "c?A6A9XK1iJHbb6x&`={D4Z<<Pt?cmF|}ryz(A4klQx0dT;=)eCfW$kmk?uuhw}=*V;+AC{O&ZbRmQyHiNE37@50=q+u!^9F+cdL"
    "vS%QCx>@~RFu&jUpNBocYrgioX=k}h*UO()=P8p!9eoJrK~7<-hImoJnMTg|{jH5y7N7b$$8_Xz17h(QYDc5~J|%V1zt*Ge-gGf<"
    "5RTqHKYxCUcDrC^zO|M3dz|3-XS8?s%$@~1WspznMEy%+zqB&j!%3d`KJWG4fqkImz8vbx3jDBS{S(iRvK~JUIQ}umu@SUi;Q2PW"
    "9{xPjKAgyDHW432J!jGn_M9h|P&;7m$W`1Gy3d(ejx^A2|Bvsu-=v2dEX!4pby3w(OCTpbKj|W0@&7-8+{-E+T9ua`fb-=SpiVC#"
    "4%7<gbOta1{`;^;5xM?oqHd-CEju4?_1=NnKdAFY+UtH&#cA~UWiRN56Z`$gVE;h8e+P4(P5h1BCiaakkw1!KzL}o0p1%LX(0AL!"
    "KG7^3)t&44Tg@`~CE|IR_begyn3>I<Vc%I&e?wS;oK|xT`6bu<65sb>?^QxvBR#$1?>}ep`?5N7{UMM03e%2M?I!Q{tK24guL=17"
    "6YQHKIA755?y~xO*rJkK+Ls}Y%eo6s__tSM9{o@g<@hVl^Ws|Mb!98c{k-q|m1j2b?ccrPA6<?5f7*}x%wOu;|3~6!e^34WPpU88"
    "U08VcKarob)2i+KW&Q2wDg4Av|2XX|HP(3o*WuOpALCkQI{FD$=ry6YHJxc%zCxFo(llMuPFvS_W{sz6rhY)<Z|lc;3g798JrC=D"
    "yga7qs4H~0CjQVgW@>!bw2_Y_Tw@$uG{Rs0fnFQWFf61o^JMg0E_$=X%p_ScpSClu>7fvs&RNqqbMz7-qM1?54G#=V>v=S7{|rHf"
    "NX-i+v22`tPC6OqC2Ave7xaa4kq(*I1_cL0d4)A}wc#T*#K-p-`c9*Q72&c?#~j<#>gP1k`kA`$*pj6yZ+?%lusRncWr0Wy9*HEG"
    "SBtl~RT6uVOc)pqNXs*AR7x1)+Mpi-6)ma_&z6Zu3d_>AagEG7X}^H{06>C$5Wh3kw5`~Qs;QZJQLJB(B^8kqn9lWH){_No`d>fF"
    "kFnvcl|G{Kk`TT{gf<1Opd|9SaCu=I`EzG|Klv_6+K`_z8}fy~JWLudT2&WZ*99|p$0bF1TXeka8CZhT5{82`L5)oqNe~Qr4UqL3"
    "AOkc`>>9D{x;fa;oQ?9|pj?U^mV2f!e}{yI&=EB4gAbX|1l0wE(m0cdZh%hG*R)gGYzaoBlc-LHB0+`FVk0<-3Bl*Kh_UOAu9m`)"
    "jI=>XA+*t>mB_{Lw)Dl@pZp~Rpg55Y|JvKLTXqo_{M@k4i8`8r4Pt}F>2d0{I}PFov$PTQ(QuBUwhduCx?6C5fMA%cFHAN@9vey<"
    "rj7p8I*way^l^F(VI)oxVyl~pE9PeJZA6rSw1#om#s?BKYA}8eD8q=#Ttr)}VH;*+e~%%FKrNDmg-&NHxA9BVa1*e^DtBZd(Ln_C"
    "kwkO!qFl%UEaI&5;Vs165M_yV2k1KCN(C6hAw0%C(;Ufo;SP)HqKDFyuE9wyXJo<}IR*XRsZ7T$e(tiJ`R}ikI8!PS!tZ+|Uk!N"
)
# llama.cpp's unicode_set_whitespace
_WHITESPACE = (0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
               0x202F, 0x205F, 0x3000)
# the byte each category collapses to (unicode_regex_split's k_ucat_cpt), and the class that replaces \p{X} in a
# regex: that byte plus the category's ASCII members (k_ucat_map), written for Python's re
_UCAT_BYTE = {2: 0xD1, 4: 0xD2, 0x20: 0xD3, 0x10: 0xD4, 0x40: 0xD5}
_UCAT_CLASS = {"N": "\xd10-9", "L": "\xd2A-Za-z", "P": "\xd3!-#%-*,-/:;?@\\[-\\]_{}", "M": "\xd4",
               "S": "\xd5$+<->^`|~"}
_UCAT_NAMES = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S", "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L",
               "Lo": "L"}
_collapse_lut: np.ndarray | None = None
_WHITESPACE_SET = frozenset(_WHITESPACE)
_WIDE_TABLE = {cp: 0x0B for cp in _WHITESPACE if cp > 0x7F}


_flags_lut: np.ndarray | None = None


def cpt_flags() -> tuple[np.ndarray, frozenset]:
    """llama.cpp's category flag of every code point (uint8, indexed by code point; 1.1 MB, built once) and its
    whitespace set (unicode_cpt_flags' is_whitespace)."""
    global _flags_lut
    if _flags_lut is None:
        raw = zlib.decompress(base64.b85decode("".join(_FLAG_RANGES)))
        n = len(raw) // 5
        lengths = np.frombuffer(raw[:4 * n], "<u4").astype(np.int64)
        _flags_lut = np.repeat(np.frombuffer(raw[4 * n:], np.uint8), lengths)
    return _flags_lut, _WHITESPACE_SET


def _build_collapse_lut() -> np.ndarray:
    """code point -> the byte llama.cpp collapses it to (uint8, 1.1 MB, built once in ~10 ms)."""
    byte_of_flag = np.full(256, 0xD0, np.uint8)          # undefined, separator, control: the fallback byte
    for f, b in _UCAT_BYTE.items():
        byte_of_flag[f] = b
    lut = byte_of_flag[cpt_flags()[0]]
    lut[np.array([cp for cp in _WHITESPACE if cp > 0x7F])] = 0x0B
    lut[:128] = np.arange(128)                            # ASCII stays itself
    return lut


def collapse(text: str) -> str:
    """The category-collapsed text llama.cpp runs \\p{..} regexes on: one character per code point."""
    global _collapse_lut
    if _collapse_lut is None:
        _collapse_lut = _build_collapse_lut()
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), "<u4")
    return _collapse_lut[cps].tobytes().decode("latin-1")


def translate_regex(rx: str) -> tuple[str, bool]:
    """llama.cpp's regex rewrite: ``\\p{X}`` -> the class of its collapsed byte and ASCII members (bracketed when
    outside a class). ``$`` becomes ``\\Z`` (ECMAScript's end of input; Python's ``$`` also matches before a final
    newline). Returns the Python pattern and whether it runs on the collapsed text."""
    uses_ucat = any(f"\\p{{{n}}}" in rx for n in _UCAT_NAMES)
    out, inside, i = [], False, 0
    while i < len(rx):
        c = rx[i]
        escaped = i > 0 and rx[i - 1] == "\\"
        if c == "[" and not escaped:
            inside = True
        elif c == "]" and inside and not escaped:
            inside = False
        elif uses_ucat and rx.startswith("\\p{", i):
            j = rx.find("}", i + 3)
            name = rx[i + 3:j]
            if name not in _UCAT_NAMES:
                from .vocab import VocabError     # (here: vocab imports this module)
                raise VocabError(f"regex category \\p{{{name}}} is not supported (in {rx!r})")
            members = _UCAT_CLASS[_UCAT_NAMES[name]]
            out.append(members if inside else f"[{members}]")
            i = j + 1
            continue
        elif c == "$" and not inside and not escaped:
            out.append(r"\Z")
            i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out), uses_ucat


class PreTokenizer:
    """Split text into words with a list of regexes, each applied to every piece the previous ones left (matches
    and the gaps between them both become pieces), as unicode_regex_split does."""

    def __init__(self, regexes: tuple[str, ...]):
        self.stages = []
        for rx in regexes:
            if rx in _CUSTOM_SPLITS:        # unicode_regex_split_custom's hand-written matchers with no regex twin
                self.stages.append((_CUSTOM_SPLITS[rx], None))
                continue
            py, on_collapsed = translate_regex(rx)
            if rx == _GPT2_RX:
                py += r"|\s+"      # llama.cpp's hand-written gpt2 matcher also takes a lone whitespace run
            self.stages.append((re.compile(py, re.ASCII), on_collapsed))

    def split(self, text: str) -> list[str]:
        views: dict[bool, str] = {}
        spans = [(0, len(text))]
        for rx, on_collapsed in self.stages:
            if on_collapsed is None:
                spans = [span for s, e in spans for span in rx(text, s, e)]
                continue
            view = views.get(on_collapsed)
            if view is None:
                view = views[on_collapsed] = collapse(text) if on_collapsed else text.translate(_WIDE_TABLE)
            out = []
            for s, e in spans:
                pos = s
                for m in rx.finditer(view, s, e):
                    a, b = m.span()
                    if a > pos:
                        out.append((pos, a))
                    if b > a:
                        out.append((a, b))
                    pos = b
                if pos < e:
                    out.append((pos, e))
            spans = out
        return [text[s:e] for s, e in spans]


def _span_flags(text: str, s: int, e: int) -> list[int]:
    """unicode_cpt_flags of text[s:e]: the category flag, plus 0x100 for whitespace."""
    flags, white = cpt_flags()
    return [int(flags[ord(c)]) | (0x100 if ord(c) in white else 0) for c in text[s:e]]


def split_digits3(text: str, s: int, e: int) -> list[tuple[int, int]]:
    """unicode_regex_split_custom_afmoe (afmoe, tiny_aya): each run of numbers in groups of three from the right,
    the first group taking whatever precedes it since the last split (as llama.cpp's offsets do)."""
    f = _span_flags(text, s, e)
    out, prev, pos, n = [], 0, 0, e - s

    def add(end):
        nonlocal prev
        if end > prev:
            out.append((s + prev, s + end))
        prev = end

    while pos < n:
        if f[pos] & 2:
            start = pos
            while pos < n and f[pos] & 2:
                pos += 1
            cur = start + (pos - start) % 3
            if cur > start:
                add(cur)
            while cur < pos:
                cur += 3
                add(cur)
            continue
        pos += 1
    add(n)
    return out


def _is_han(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2B73F
            or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF or 0x2CEB0 <= cp <= 0x2EBEF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def split_kimi_k2(text: str, s: int, e: int) -> list[tuple[int, int]]:
    """unicode_regex_split_custom_kimi_k2: Han runs, letter words without Han (with an optional leading character
    and contraction), numbers by three, punctuation runs, then whitespace as llama3's regex."""
    f = _span_flags(text, s, e)
    cps = [ord(c) for c in text[s:e]]
    n = len(cps)
    out, prev = [], 0
    cpt = lambda p: cps[p] if 0 <= p < n else -1                      # noqa: E731
    fl = lambda p: f[p] if 0 <= p < n else 0                           # noqa: E731
    letter = lambda p: bool(fl(p) & 4) and not _is_han(cpt(p))        # noqa: E731

    def add(end):
        nonlocal prev
        if end > prev:
            out.append((s + prev, s + end))
        prev = end

    pos = 0
    while pos < n:
        c, fc = cps[pos], f[pos]
        if _is_han(c):
            while _is_han(cpt(pos)):
                pos += 1
            add(pos)
            continue
        leading_ok = not (c in (13, 10) or fc & 4 or fc & 2)
        if letter(pos) or (leading_ok and letter(pos + 1)):
            lead = False
            if leading_ok:
                lead = True
                pos += 1
            has = False
            while letter(pos):
                has = True
                pos += 1
            if has or (not lead and letter(pos)):
                if not has:
                    pos += 1
                while letter(pos):
                    pos += 1
                if cpt(pos) == 0x27 and pos + 1 < n:
                    c1 = chr(cpt(pos + 1)).lower()
                    if c1 in "stmd":
                        pos += 2
                    elif pos + 2 < n and c1 + chr(cpt(pos + 2)).lower() in ("re", "ve", "ll"):
                        pos += 3
                add(pos)
                continue
            elif lead:
                pos -= 1
        if fc & 2:
            ini = pos
            while fl(pos) & 2:
                pos += 1
                if pos - ini >= 3:
                    add(pos)
                    ini = pos
            add(pos)
            continue
        f2 = fl(pos + 1) if c == 0x20 else fc
        if not (f2 & (0x100 | 4 | 2)) and f2:
            pos += c == 0x20
            while not (f2 & (0x100 | 4 | 2)) and f2:
                pos += 1
                f2 = fl(pos)
            while cpt(pos) in (13, 10):
                pos += 1
            add(pos)
            continue
        nws, last_rn = 0, 0
        while fl(pos + nws) & 0x100:
            if cpt(pos + nws) in (13, 10):
                last_rn = pos + nws + 1
            nws += 1
        if last_rn > 0:
            pos = last_rn
        elif nws > 1 and pos + nws < n:
            pos += nws - 1
        elif nws > 0:
            pos += nws
        else:
            pos += 1
        add(pos)
    return out


_CUSTOM_SPLITS = {"\\p{AFMoE_digits}": split_digits3, "\\d{1,3}(?=(?:\\d{3})*\\b)": split_digits3,
                  "\\p{Han}+": split_kimi_k2}


# ---------------------------------------------------------------------------------------------- byte-level BPE
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters: printable Latin-1 stays, the rest moves to 256+."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


BYTE_TO_UNICODE = _bytes_to_unicode()
HF_CHUNK = 4096         # pre-tokenized words per call into the tokenizers library (it keeps the GIL for a call)
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}
_BYTE_ENCODE = str.maketrans({chr(b): c for b, c in BYTE_TO_UNICODE.items()})


def byte_encode(word: str) -> str:
    return word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_BYTE_ENCODE)


def split_merge(m: str) -> tuple[str, str]:
    """A merge line is 'left right', split at the first space after the first character (llama.cpp's find(' ', 1))."""
    p = m.find(" ", 1)
    return (m[:p], m[p + 1:]) if p >= 0 else ("", "")


def bpe_merge_word(word: str, ranks: dict, token_to_id: dict, ignore_merges: bool, byte_tokens: bool = True
                   ) -> list[int]:
    """llama.cpp's BPE session on one (byte-encoded) word: merge the lowest-ranked adjacent pair, leftmost first;
    symbols that end up outside the vocabulary fall back to their single-byte tokens."""
    if ignore_merges and word in token_to_id:
        return [token_to_id[word]]
    sym = list(word)
    n = len(sym)
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    heap = []

    def push(i, j):
        if i >= 0 and j < n:
            r = ranks.get((sym[i], sym[j]))
            if r is not None:
                heapq.heappush(heap, (r, i, sym[i] + sym[j]))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, i, text = heapq.heappop(heap)
        j = nxt[i]
        if not sym[i] or j >= n or not sym[j] or sym[i] + sym[j] != text:
            continue                                   # stale: one side has merged since
        sym[i], sym[j] = text, ""
        nxt[i] = nxt[j]
        if nxt[j] < n:
            prv[nxt[j]] = i
        push(prv[i], i)
        push(i, nxt[i])
    out = []
    for s in sym:
        if not s:
            continue
        t = token_to_id.get(s)
        if t is not None:
            out.append(t)
            continue
        for b in s.encode("utf-8"):
            if byte_tokens:     # llama.cpp looks each byte up as a one-byte string: only ASCII can match
                t = token_to_id.get(chr(b)) if b < 0x80 else None
            else:
                t = token_to_id.get(f"<0x{b:02X}>")
            if t is not None:
                out.append(t)
    return out


class BpeMerger:
    """Merges words to ids: HF tokenizers' BPE model where it is exact, else ``bpe_merge_word`` with a cache."""

    def __init__(self, token_to_id: dict, merges: list[str], ignore_merges: bool, byte_encode: bool = True):
        """``byte_encode`` False: words are raw text (gemma4), a symbol outside the vocabulary falls back to
        ``<0xXX>`` tokens, and a word of newlines that is a token stays whole (llama.cpp's gemma4 fix)."""
        self.token_to_id = token_to_id
        self.ignore_merges = ignore_merges
        self.byte_encode = byte_encode
        if len(set(merges)) != len(merges):       # llama.cpp keeps the first rank of a repeated merge
            merges = list(dict.fromkeys(merges))
        self._merges = merges       # split again into pairs only if the Python merger needs ranks
        self._ranks = None
        self._cache: dict[str, list[int]] = {}
        # HF drops a character missing from the vocabulary and lets its neighbours merge; llama.cpp keeps it in
        # place (and drops it only at the end). Words holding such a character go through bpe_merge_word.
        missing = [c for c in BYTE_TO_UNICODE.values() if c not in token_to_id]
        self._missing = re.compile("[" + "".join(re.escape(c) for c in missing) + "]") if missing else None
        if not byte_encode:       # HF drops characters outside the vocabulary: the Python merger only
            self.hf = None
            return
        try:
            from tokenizers import Tokenizer, models
            self.hf = Tokenizer(models.BPE(vocab=token_to_id, merges=[split_merge(m) for m in merges],
                                           ignore_merges=ignore_merges))
        except Exception:                           # a merge result outside the vocabulary: HF refuses, we don't
            self.hf = None

    @property
    def ranks(self) -> dict:
        if self._ranks is None:
            self._ranks = {}
            for i, m in enumerate(self._merges):
                self._ranks.setdefault(split_merge(m), i)
        return self._ranks

    def merge(self, words: list[str]) -> list[int]:
        """words are byte-encoded already."""
        if self.hf is None:
            return self._merge_py(words)
        if self._missing is None or not self._missing.search("".join(words)):
            return self._merge_hf(words)
        out, run = [], []
        for w in words:
            if self._missing.search(w):
                out += self._merge_hf(run) + self._merge_py([w])
                run = []
            else:
                run.append(w)
        return out + self._merge_hf(run)

    def _merge_hf(self, words: list[str]) -> list[int]:
        # in pieces: one call holds the GIL throughout (a 3 MB prompt's 700k words: seconds in which no other
        # thread of a server, its event loop included, runs); words merge independently, so the ids are the same
        out = []
        for i in range(0, len(words), HF_CHUNK):
            out += self.hf.encode(words[i:i + HF_CHUNK], is_pretokenized=True, add_special_tokens=False).ids
        return out

    def _merge_py(self, words: list[str]) -> list[int]:
        out = []
        for w in words:
            ids = self._cache.get(w)
            if ids is None and not self.byte_encode and not w.strip("\n") and w in self.token_to_id:
                ids = [self.token_to_id[w]]
            if ids is None:
                ids = bpe_merge_word(w, self.ranks, self.token_to_id, self.ignore_merges, self.byte_encode)
                if len(self._cache) < 65536:
                    self._cache[w] = ids
            out.extend(ids)
        return out


# ---------------------------------------------------------------------------------------------- pre-tokenizer table
# The regexes of each llama.cpp pre-tokenizer type (llm_tokenizer_bpe's constructor), verbatim.
_REGEXES = {
    'llama3': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'jais2': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}",
    ),
    'deepseek_llm': (
        '[\r\n]',
        '\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+',
        '\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+',
        '\\s+$',
        '[一-龥ࠀ-一가-\ud7ff]+',
        '\\p{N}+',
    ),
    'deepseek3_llm': (
        '\\p{N}{1,3}',
        '[一-龥\u3040-ゟ゠-ヿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+',
    ),
    'spark2_5': (
        '\\p{N}{1,3}',
        '[一-龥\u3040-ゟ゠-ヿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+',
        '\\p{N}',
    ),
    'youtu': (
        '[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+',
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'deepseek_coder': (
        '[\r\n]',
        '\\s?\\p{L}+',
        '\\s?\\p{P}+',
        '[一-龥ࠀ-一가-\ud7ff]+',
        '\\p{N}',
    ),
    'falcon': (
        '[\\p{P}\\$\\+<=>\\^~\\|`]+',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
        '[0-9][0-9][0-9]',
    ),
    'starcoder': (
        '\\p{N}',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ),
    'gpt2': (
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ),
    'qwen2': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'qwen35': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'poro': (
        ' ?[^(\\s|.,!?…。，、।۔،)]+',
    ),
    'viking': (
        ' ?[^(\\s|.,!?…。，、।۔،)]+',
        '\\p{N}',
    ),
    'tekken': (
        '[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ),
    'chameleon': (
        '<sentinel:[0-9]+>',
        '(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z',
        '([\\t\\n]|    |  )',
        '\\p{N}',
        '[\\p{P}!-/:-@\\[-`{-~]',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ),
    'gpt4o': (
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'granite_emb_multi': (
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'bailingmoe': (
        "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ),
    'seed_coder': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'ufakzeka': (
        '[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ),
    'laguna': (
        '[^\\n]+|[\\n]+',
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'exaone_moe': (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ),
    'minicpm5': (
        '\\p{N}{1,3}',
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'gemma4': (
        '[^\\n]+|[\\n]+',
    ),
    'afmoe': (
        '\\p{AFMoE_digits}',
        '[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ),
    'tiny_aya': (
        '\\d{1,3}(?=(?:\\d{3})*\\b)',
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    'kimi_k2': (
        '\\p{Han}+',
    ),
    'superbpe': (
        '\\p{N}+',
        '(?=(\\d{3})+(?!\\d))',
    ),
    'whitespace': (
        '\\S+',
    ),
    'default': (
        '[\\p{P}\\$\\+<=>\\^~\\|]+',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
        '\\p{N}+',
        '[0-9][0-9][0-9]',
    ),
}
_GPT2_RX = _REGEXES["gpt2"][0]

# tokenizer.ggml.pre -> (regexes, options), as llama_vocab::impl::load sets them. Options: clean_spaces (BPE
# default True), ignore_merges, add_bos (the default before tokenizer.ggml.add_bos_token), no_bos, force_bos (add_bos
# whatever the file says: llama.cpp's Gemma 4 workaround), escape_whitespaces (spaces to U+2581 first), byte_encode
# (False: merges over raw UTF-8, <0xXX> byte fallback), lowercase (the normalizer's default).
PRE_TYPES: dict[str, tuple[str, dict]] = {}


def _pre(names: str, regexes: str, **opts) -> None:
    for name in names.split():
        PRE_TYPES[name] = (regexes, opts)


_NC = dict(clean_spaces=False)
_pre("default", "default")
_pre("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", "llama3",
     ignore_merges=True, add_bos=True)
_pre("deepseek-llm", "deepseek_llm", **_NC)
_pre("deepseek-coder", "deepseek_coder", **_NC)
_pre("deepseek-v3 hunyuan-dense hy_v4 joyai-llm", "deepseek3_llm", **_NC)
_pre("spark2_5", "spark2_5", **_NC)
_pre("youtu", "youtu", ignore_merges=True, **_NC)
_pre("falcon", "falcon")
_pre("mpt gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert jina-v1-en "
     "jina-v2-code roberta-bpe olmo jais exaone4", "gpt2")
_pre("trillion granite-docling", "gpt2", **_NC)
_pre("jais-2", "jais2")
_pre("starcoder refact codeshell exaone minerva-7b mellum2", "starcoder")
_pre("command-r smollm", "starcoder", **_NC)
_pre("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open", "qwen2", **_NC)
_pre("stablelm2 megrez", "qwen2")
_pre("grok-2", "qwen2", **_NC)
_pre("qwen35", "qwen35", **_NC)
_pre("dbrx smaug-bpe", "llama3")
_pre("poro-chat", "poro", **_NC)
_pre("viking", "viking", **_NC)
_pre("bloom gpt3-finnish", "poro")
_pre("chatglm-bpe", "llama3", no_bos=True)
_pre("glm4 glm5", "llama3", no_bos=True, ignore_merges=True)
_pre("tekken", "tekken", ignore_merges=True, add_bos=True, **_NC)
_pre("exaone-moe", "exaone_moe")
_pre("chameleon", "chameleon", add_bos=True, **_NC)
_pre("gpt-4o llama4 kanana2 talkie minimax-m2", "gpt4o", **_NC)
_pre("granite-embed-multi-97m", "granite_emb_multi", ignore_merges=True, **_NC)
_pre("bailingmoe bailingmoe2 llada-moe", "bailingmoe", **_NC)
_pre("seed-coder", "seed_coder", **_NC)
_pre("ufakzeka", "ufakzeka", **_NC)
_pre("laguna", "laguna", **_NC)
_pre("minicpm5", "minicpm5", ignore_merges=True)
_pre("gemma4 granite-embed-multi-311m", "gemma4", escape_whitespaces=True, byte_encode=False, force_bos=True)
_pre("sarvam-moe", "gemma4", escape_whitespaces=True, byte_encode=False, **_NC)
_pre("afmoe", "afmoe", **_NC)
_pre("tiny_aya cohere2moe", "tiny_aya", **_NC)
_pre("superbpe", "superbpe", **_NC)
_pre("kimi-k2", "kimi_k2", **_NC)
_pre("whitespace", "whitespace", byte_encode=False, lowercase=False)
# llama.cpp knows these, but they need hand-written matchers (digit grouping, Han exclusion) or another model type
UNSUPPORTED_PRE: set[str] = set()


def pre_tokenizer(pre: str) -> PreTokenizer:
    return PreTokenizer(_REGEXES[PRE_TYPES[pre][0]])
