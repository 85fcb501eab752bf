// ∞-Bench's scoring, task by task, as the benchmark's src/compute_scores.py computes it
// (get_score_one_*), over Unicode code points as Python's str does:
//   passkey, number_string   the prediction's first run of digits equals the answer
//   kv_retrieval             the answer is one of the prediction's words (split at white space
//                            and \n : " ' . , ? ! { })
//   math_find                the first number (\d+\.\d+|\d+) equals the answer, as an integer
//                            or a float as the answer is
//   math_calc                the share of the answer's values that the prediction's numbers
//                            (its digit runs, signs dropped, as the benchmark's) match from the
//                            start; the gpt4 family's first number is dropped (its prompt
//                            makes GPT-4 repeat the first value)
//   code_run                 the last word, as an integer, equals the answer
//   code_debug               "X." / "X:" at the start, or the option letter or function name
//                            right after "answer is:", "is:" or "answer:"
//   longbook_choice_eng      the first character is the letter (or the option's text); else
//                            after "answer is:", "answer:", "answer is" or "option is"; else the
//                            first word that is a piece of "ABCD"
//   longdialogue_qa_eng      the answer is one of the prediction's upper-cased words
//   longbook_qa_eng          token F1 after lower-casing and removing punctuation, articles and
//                            extra white space; the best over the answers
//   longbook_qa_chn          character F1 after lower-casing and removing punctuation (ASCII and
//                            Chinese) and all white space; the best over the answers
//   longbook_sum_eng         ROUGE-Lsum F (rouge_score, as HF evaluate's "rouge" computes it:
//                            lower-cased [a-z0-9] tokens, sentences at newlines, union LCS); the
//                            best over the answers
// The ground truth is GroundTruthJson's. Where the benchmark's scorer would fail on an answer
// that is a list (or not one), the first value (or the value alone) is taken. Approximations,
// each immaterial on the benchmark's data: \d and lower-casing cover ASCII (and Latin-1 for
// lower-casing), and Python's \b in the article rule treats every non-ASCII letter as a word
// character.
#pragma once

#include <string>

#include "store/status.h"

namespace kvtier::infbench {

/// The score of one prediction, in [0, 1]. `family` is the template family (math_calc's
/// gpt4 rule). A ground truth the task cannot score -> InvalidArgument naming it.
Result<double> ScoreOne(const std::string& task, const std::string& prediction,
                        const std::string& ground_truth_json, const std::string& family = "");

/// ROUGE-Lsum's F-measure of `prediction` against `reference` (see above).
double RougeLsum(const std::string& prediction, const std::string& reference);

}  // namespace kvtier::infbench
