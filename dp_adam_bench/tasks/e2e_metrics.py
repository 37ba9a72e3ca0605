"""Corpus metrics of the E2E NLG Challenge as Li et al. report them: BLEU and ROUGE-L, on a 0-100 scale.

X. Li, F. Tramèr, P. Liang, T. Hashimoto, "Large language models can be strong differentially private learners"
(ICLR 2022, arXiv:2110.05679), E2E table-to-text results (full fine-tuning): GPT-2 on E2E, BLEU 61.519 and
ROUGE-L 65.670 at ε = 3 (69.463 / 71.359 non-private; ``configs/paper/li.yaml``). Their numbers come from the
official E2E scorer (J. Novikova, O. Dušek, V. Rieser, "The E2E dataset: new challenges for end-to-end generation",
SIGDIAL 2017, arXiv:1706.09254; ``e2e-metrics/measure_scores.py``), which scores each generated text against ALL
human references of its meaning representation (MR). What that scorer computes, and what
these functions reproduce with maintained packages:

* **BLEU** — ``pymteval.BLEUScore`` / ``mteval-v13a.pl``: corpus-level BLEU-4 with the mteval-v13a tokenisation,
  case-insensitive, n-gram counts clipped by the maximum count in any one reference, the brevity penalty against the
  reference closest in length (ties: the shorter), no smoothing. :func:`bleu` is ``sacrebleu.corpus_bleu`` with
  ``tokenize="13a"``, ``lowercase=True`` and ``smooth_method="none"``: the same definition (sacreBLEU was written to
  reproduce mteval-v13a). MRs have between 1 and 45 references; the shorter reference lists are padded with None,
  which sacreBLEU drops (an empty string would count as a reference of length 0).
* **ROUGE-L** — ``pycocoevalcap.rouge.Rouge`` (the MS-COCO caption scorer the E2E script calls): per MR, the LCS
  precision P_j = LCS/|hyp| and recall R_j = LCS/|ref_j| against each reference j; then the F-measure with β = 1.2
  of the MAXIMUM precision and the MAXIMUM recall (possibly from different references),
  F = (1 + β²) P R / (R + β² P); averaged over MRs. This is not "the best F1 over the references" (what
  ``rouge_score.RougeScorer.score_multi`` returns): :func:`rouge_l` uses ``rouge_score`` for the per-reference LCS
  precision and recall and combines them as the E2E scorer does.
  Tokenisation: the COCO scorer runs the Stanford PTB tokenizer (Java, not available here), lower-cased, and drops
  punctuation tokens; :func:`coco_tokens` approximates it by lower-casing, the 13a tokenisation and dropping the same
  punctuation tokens (it keeps "café" and "£30" whole where PTB would split "£" off: a small difference).

Not computed (the E2E scorer also prints them):

* **NIST** — ``nltk.translate.nist_score.corpus_nist`` exists, but it scores each output against its single best
  reference and uses that reference's length, whereas mteval-v13a (E2E) clips against the merged multi-reference
  n-gram counts and uses the average reference length: its numbers would not be comparable, so it is left out.
* **METEOR** — ``nltk``'s ``meteor_score`` needs the WordNet corpus (not available offline), and E2E uses the Java
  METEOR 1.5 with paraphrase tables, which nltk does not reproduce.
* **CIDEr** — needs ``pycocoevalcap`` (not installed; its tokenizer is Java).

Li et al.'s headline table reports BLEU and ROUGE-L, the two computed here.
"""

from __future__ import annotations

from collections.abc import Sequence

# the punctuation tokens pycocoevalcap's PTBTokenizer removes (after mapping brackets to -LRB- etc.)
PTB_PUNCTUATION = frozenset(
    ["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".", "?", "!", ",", ":", "-", "--", "...", ";"]
    + ["(", ")", "{", "}", "[", "]", '"']
)
ROUGE_BETA = 1.2  # pycocoevalcap: "updated the value below based on discussion with Hovey"


def _check(hyps: Sequence[str], refs_per_hyp: Sequence[Sequence[str]]) -> None:
    if len(hyps) != len(refs_per_hyp):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs_per_hyp)} reference lists")
    if not hyps:
        raise ValueError("no hypotheses to score")
    for i, refs in enumerate(refs_per_hyp):
        if isinstance(refs, str) or len(refs) == 0:
            raise ValueError(f"hypothesis {i} needs a non-empty list of reference strings, got {refs!r}")


def bleu(hyps: Sequence[str], refs_per_hyp: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU-4 (0-100) of ``hyps[i]`` against all of ``refs_per_hyp[i]``, as the E2E scorer computes it
    (mteval-v13a tokenisation, case-insensitive, closest reference length, no smoothing); see the module docstring."""
    import sacrebleu

    _check(hyps, refs_per_hyp)
    k = max(len(r) for r in refs_per_hyp)
    # sacreBLEU wants reference *streams*: stream j holds the j-th reference of every segment (None: it has fewer)
    streams = [[refs[j] if j < len(refs) else None for refs in refs_per_hyp] for j in range(k)]
    return float(
        sacrebleu.corpus_bleu(
            list(hyps), streams, tokenize="13a", lowercase=True, smooth_method="none", force=True
        ).score
    )


class _CocoLikeTokenizer:
    """Lower-case, mteval-v13a tokenisation, PTB punctuation tokens dropped (see :func:`coco_tokens`)."""

    def __init__(self):
        from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

        self._13a = Tokenizer13a()

    def tokenize(self, text: str) -> list[str]:
        return [t for t in self._13a(text.lower()).split() if t not in PTB_PUNCTUATION]


def coco_tokens(text: str) -> list[str]:
    """The tokens ROUGE-L compares: an approximation of pycocoevalcap's lower-cased PTB tokenisation without
    punctuation (``"The Vaults, a pub."`` -> ``["the", "vaults", "a", "pub"]``)."""
    return _CocoLikeTokenizer().tokenize(text)


def rouge_l_f(precision: float, recall: float, beta: float = ROUGE_BETA) -> float:
    """pycocoevalcap's ROUGE-L F-measure of a precision and a recall (0 when either is 0)."""
    if precision == 0 or recall == 0:
        return 0.0
    return (1 + beta**2) * precision * recall / (recall + beta**2 * precision)


def rouge_l(hyps: Sequence[str], refs_per_hyp: Sequence[Sequence[str]], beta: float = ROUGE_BETA) -> float:
    """ROUGE-L (0-100) as the E2E scorer computes it: per MR, F_β of the maximum LCS precision and the maximum LCS
    recall over its references, averaged over MRs (β = 1.2); see the module docstring."""
    from rouge_score import rouge_scorer

    _check(hyps, refs_per_hyp)
    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_CocoLikeTokenizer())
    total = 0.0
    for hyp, refs in zip(hyps, refs_per_hyp, strict=True):
        scores = [scorer.score(ref, hyp)["rougeL"] for ref in refs]  # score(target, prediction)
        total += rouge_l_f(max(s.precision for s in scores), max(s.recall for s in scores), beta)
    return 100.0 * total / len(hyps)
