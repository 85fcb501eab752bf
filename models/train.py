"""Trains kvtier-tiny (models/model.py) on the models/tasks.py mix, CPU, fixed seeds.

Regenerate the shipped weights (from the repository root; Debian python3-torch 1.13,
2 threads; see models/README.md for the recipe and the measured curve):

    /usr/bin/python3 models/train.py --ffn 256 --batch 8 --lr 1e-3 --warmup 50 --steps 3000 \
        --max-minutes 27 --stages 0:256,0.3:512 --eval-every 50 \
        --mix passkey:0.35,number_string:0.1,kv_retrieval:0.1,text:0.1,copy:0.35 \
        --out models/kvtier-tiny.safetensors --log models/train_log.txt

(these are also the defaults). Took 27.1 min / 1,099 steps on a 2-core VM; the LR
schedule and curriculum follow max(step/steps, elapsed/max_minutes), so the step
count depends on machine speed. The init hand-sets an approximate induction circuit
(prevtok_init, induction_init) that training then sharpens.

Writes (fp16, same __metadata__ keys as make_fixture.py) the checkpoint with the best
held-out passkey exact match at the final training length, evaluated every
--eval-every steps on --val-samples validation samples (seed 2; models/eval.py
reports on seed 1), and the training curve to --log.
"""
import argparse
import math
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as kvmodel  # noqa: E402
import safetensors_io  # noqa: E402
import tasks  # noqa: E402

MIN_LEN = {"passkey": 256, "number_string": 300, "kv_retrieval": 200, "text": 64, "copy": 64}


def parse_mix(s):
    out = []
    for part in s.split(","):
        k, v = part.split(":")
        out.append((k, float(v)))
    return out


def parse_stages(s):
    """"0:256,0.5:512,0.8:1024" -> [(fraction of steps, max length)]."""
    return [(float(a), int(b)) for a, b in (p.split(":") for p in s.split(","))]


def stage_len(stages, frac):
    L = stages[0][1]
    for f, l in stages:
        if frac >= f:
            L = l
    return L


def make_batch(rng, mix, L, batch, ans_weight):
    names = [k for k, _ in mix]
    weights = [w for _, w in mix]
    seqs, ws, is_ans = [], [], []
    Lb = rng.randint(L // 2, L)  # one length per batch (little padding); positions vary
    for _ in range(batch):
        task = rng.choices(names, weights)[0]
        lo = max(MIN_LEN[task], Lb // 2)
        n = rng.randint(lo, max(lo, Lb))
        p, a = tasks.make_sample(task, n, rng)
        s = list(p + a)
        w = [1.0] * len(p) + [ans_weight if task in tasks.RETRIEVAL_TASKS else 1.0] * len(a)
        f = [0] * len(p) + [{"passkey": 1, "number_string": 2, "kv_retrieval": 2, "copy": 3}.get(task, 0)] * len(a)
        seqs.append(s)
        ws.append(w)
        is_ans.append(f)
    T = max(len(s) for s in seqs)
    tok = torch.zeros(batch, T, dtype=torch.long)
    wt = torch.zeros(batch, T)
    ans = torch.zeros(batch, T, dtype=torch.long)
    for i, (s, w, f) in enumerate(zip(seqs, ws, is_ans)):
        tok[i, :len(s)] = torch.tensor(s)
        wt[i, :len(s)] = torch.tensor(w)
        ans[i, :len(s)] = torch.tensor(f)
    # predict token t+1 from prefix ..t: targets/weights shift by one
    return tok[:, :-1], tok[:, 1:], wt[:, 1:], ans[:, 1:]


@torch.no_grad()
def exact_match(m, samples, bs=25):
    """Greedy exact match via teacher forcing (identical: greedy is right iff every
    answer byte is the argmax given the right prefix). Prompts of one task and length
    all have the same length, so samples stack."""
    m.eval()
    ok = 0
    for i in range(0, len(samples), bs):
        chunk = samples[i:i + bs]
        pl = len(chunk[0][0])
        assert all(len(p) == pl for p, _ in chunk)
        seq = torch.tensor([list(p + a) for p, a in chunk])
        logits = m(seq[:, :-1])
        pred = logits[:, pl - 1:].argmax(-1)
        ok += int((pred == seq[:, pl:]).all(-1).sum())
    m.train()
    return ok / len(samples)


def init_weights(m, n_layers):
    torch.manual_seed(0)
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            continue
        std = 0.02
        if name.endswith("wo.weight") or name.endswith("w_down.weight"):
            std = 0.02 / math.sqrt(2 * n_layers)
        torch.nn.init.normal_(p, 0.0, std)


def prevtok_init(m, cfg, amp=9.0, pair_w=(1.0, 1.0, 0.5, 0.5)):
    """Induction-friendly start: layer 0's q heads 0-3 (sharing kv head 0) attend to the
    tokens 1, 2, 3, 4 positions back from the first step, so layers >= 1 only have to
    learn the content match (the second half of an induction head). Embedding channel 0
    is a constant 1; through RoPE a constant q/k gives score
    amp^2/sqrt(hd) * sum_i w_i cos(f_i (d - r)) over the fastest pairs i, which peaks at
    distance d = r. Everything stays trainable."""
    hd = cfg["d_model"] // cfg["q_heads"]
    half = hd // 2
    f = [cfg["rope_theta"] ** (-2.0 * i / hd) for i in range(half)]
    l0 = m.layers[0]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        m.embed.weight.copy_(torch.randn(m.embed.weight.shape, generator=g))
        m.embed.weight[:, 0] = 1.0
        l0.wk.weight[:hd].zero_()
        for h in range(4):
            l0.wq.weight[h * hd:(h + 1) * hd].zero_()
        for i, w in enumerate(pair_w):
            l0.wk.weight[i, 0] = amp * math.sqrt(w)
            for h in range(4):
                r = h + 1
                l0.wq.weight[h * hd + i, 0] = amp * math.sqrt(w) * math.cos(f[i] * r)
                l0.wq.weight[h * hd + i + half, 0] = -amp * math.sqrt(w) * math.sin(f[i] * r)
        d = cfg["d_model"]
        l0.wv.weight[:hd].copy_(torch.randn(hd, d, generator=g) / math.sqrt(d))
        l0.wv.weight[:hd, 0] = 0.0
        l0.wo.weight[:, :4 * hd].copy_(torch.randn(d, 4 * hd, generator=g) * 0.5 / math.sqrt(4 * hd))
        l0.wo.weight[0, :] = 0.0


def induction_init(m, cfg, beta=0.5, b=4.0):
    """A complete (approximate) induction circuit at step 0, on top of prevtok_init:
    embed = [1 | 0 | code_t (16, channels 16..31) | 0 | random (channels 64..127)];
    layer 0 head 0 (offset 1) copies the previous token's code into channels 32..47
    (heads 1-3, offsets 2-4, write only into channels 64..127); layer 1 q head 0
    matches the current token's code against the previous-token code through the 8
    slowest RoPE channels (nearly position-free) and copies the attended token's code into
    channels 48..63; lm_head reads those with beta * code_t. The codes are random, so
    matching and read-out are noisy; training sharpens them."""
    hd = cfg["d_model"] // cfg["q_heads"]
    d = cfg["d_model"]
    g = torch.Generator().manual_seed(2)
    code = torch.randn(cfg["vocab"], 16, generator=g)
    eye = torch.eye(16)
    slow = [4, 5, 6, 7, 12, 13, 14, 15]
    M = torch.linalg.qr(torch.randn(16, 16, generator=g))[0][:8] * math.sqrt(16 / 8)
    l0, l1 = m.layers[0], m.layers[1]
    with torch.no_grad():
        E = torch.zeros(cfg["vocab"], d)
        E[:, 0] = 1.0
        E[:, 16:32] = code
        E[:, 64:] = torch.randn(cfg["vocab"], d - 64, generator=g)
        m.embed.weight.copy_(E)
        l0.wv.weight[:hd].zero_()
        l0.wv.weight[:hd, 16:32] = eye
        l0.wo.weight[:, :4 * hd].zero_()
        l0.wo.weight[32:48, 0:hd] = eye
        l0.wo.weight[64:, hd:4 * hd].copy_(torch.randn(d - 64, 3 * hd, generator=g) * 0.5 / math.sqrt(3 * hd))
        l1.wq.weight[:hd].zero_()
        l1.wk.weight[:hd].zero_()
        l1.wq.weight[slow, 16:32] = b * M
        l1.wk.weight[slow, 32:48] = b * M
        l1.wv.weight[:hd].zero_()
        l1.wv.weight[:hd, 16:32] = eye
        l1.wo.weight[:, :hd].zero_()
        l1.wo.weight[48:64, :hd] = eye
        m.lm_head.weight[:, 48:64] = beta * code


def save(m, cfg, path):
    tmp = path + ".tmp"
    safetensors_io.save(tmp, m.tensors(), kvmodel.config_to_metadata(cfg), "F16")
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--induction-init", type=int, default=1, help="also hand-set an induction circuit (layers 0-1)")
    ap.add_argument("--prevtok-init", type=int, default=1, help="hand-set previous-token heads in layer 0 (1) or not (0)")
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--ans-weight", type=float, default=5.0)
    ap.add_argument("--stages", default="0:256,0.3:512")
    ap.add_argument("--mix", default="passkey:0.35,number_string:0.1,kv_retrieval:0.1,text:0.1,copy:0.35")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--val-samples", type=int, default=50)
    ap.add_argument("--max-minutes", type=float, default=27, help="stop early (keeps the best checkpoint)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="models/kvtier-tiny.safetensors")
    ap.add_argument("--log", default="models/train_log.txt")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    cfg = {"vocab": 256, "d_model": a.d_model, "n_layers": a.layers, "q_heads": 8, "kv_heads": 2,
           "ffn_hidden": a.ffn, "rope_theta": a.rope_theta, "norm_eps": 1e-5}
    m = kvmodel.build(cfg)
    init_weights(m, a.layers)
    if a.prevtok_init:
        prevtok_init(m, cfg)
    if a.induction_init:
        induction_init(m, cfg)
    m.train()
    n_params = sum(p.numel() for p in m.parameters())
    decay = [p for n, p in m.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in m.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    mix = parse_mix(a.mix)
    stages = parse_stages(a.stages)
    final_len = max(256, stages[-1][1])
    val = {L: tasks.eval_samples("passkey", L, a.val_samples, seed=2) for L in sorted({max(256, l) for _, l in stages})}

    logf = open(a.log, "w")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except Exception:
        pass
    log("# machine: %s, %s, %d threads, torch %s" % (platform.node(), cpu, a.threads, torch.__version__))
    log("# args: " + " ".join(sys.argv[1:]))
    log("# config: %s, %d params" % (cfg, n_params))
    log("# step len loss ans_acc(retrieval) pk_ans_acc copy_acc lr elapsed_s | val passkey exact match")

    t0 = time.time()
    best = -1.0
    acc_loss, acc_n, acc_ok, acc_tot, pk_ok, pk_tot, cp_ok, cp_tot = 0.0, 0, 0, 0, 0, 0, 0, 0
    for step in range(1, a.steps + 1):
        # schedule position: by steps, or by wall time when --max-minutes would cut the run short
        frac = min(1.0, max((step - 1) / a.steps, (time.time() - t0) / (a.max_minutes * 60)))
        L = stage_len(stages, frac)
        lr = a.lr * min(1.0, step / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y, w, ans = make_batch(rng, mix, L, a.batch, a.ans_weight)
        logits = m(x)
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="none")
        loss = (ce * w.reshape(-1)).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            pred = logits.argmax(-1)
            am = (ans > 0) & (ans < 3)
            cm = ans == 3
            cp_ok += int((pred == y)[cm].sum())
            cp_tot += int(cm.sum())
            pm = ans == 1
            acc_ok += int((pred == y)[am].sum())
            acc_tot += int(am.sum())
            pk_ok += int((pred == y)[pm].sum())
            pk_tot += int(pm.sum())
            acc_loss += float(loss)
            acc_n += 1
        elapsed = time.time() - t0
        last = step == a.steps or elapsed > a.max_minutes * 60
        if step % a.eval_every == 0 or last:
            ems = {Lv: exact_match(m, s) for Lv, s in val.items()}
            em_final = ems[final_len]
            line = "%5d %5d %.4f %.3f %.3f %.3f %.2e %7.1f | %s" % (
                step, L, acc_loss / acc_n, acc_ok / max(1, acc_tot), pk_ok / max(1, pk_tot), cp_ok / max(1, cp_tot),
                lr, elapsed,
                " ".join("pk@%d=%.2f" % kv for kv in ems.items()))
            # Early in the curriculum the final length has not been trained yet: select on the
            # current stage length too (ties broken towards later checkpoints).
            score = em_final + 0.001 * ems[max(256, L)]
            if score >= best:
                best = score
                save(m, cfg, a.out)
                line += "  * saved"
            log(line)
            acc_loss, acc_n, acc_ok, acc_tot, pk_ok, pk_tot, cp_ok, cp_tot = 0.0, 0, 0, 0, 0, 0, 0, 0
        if last:
            break
    log("# done: %d steps in %.1f s (%.1f min); best val passkey@%d = %.3f; weights %s" % (
        step, time.time() - t0, (time.time() - t0) / 60, final_len, best, a.out))


if __name__ == "__main__":
    main()
