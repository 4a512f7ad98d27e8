"""Train the built-in demo model: a tiny Llama on Debian's `fortunes` corpus.

Reproducible, CPU-only, offline:

    apt-get update && apt-get install -y fortunes
    python -m pdserve.builtin.train --out pdserve/builtin/model [--minutes 15]

Steps: read the fortune cookie files (records separated by ``%`` lines), hold out a
fixed subset (written to ``heldout.txt``), train a byte-level BPE tokenizer with the
``tokenizers`` library, train a small ``LlamaForCausalLM`` (GQA) with AdamW on a mix of
plain fortunes and fortunes wrapped in the chat template, and save everything in
bfloat16 safetensors together with tokenizer files and a README.

BOS handling: ``tokenizer.json`` has no post-processor; ``tokenizer_config.json`` says
``add_bos_token: true`` (the engine's Tokenizer wrapper prepends ``<s>`` unless the text
already starts with it). The chat template emits ``{{ bos_token }}`` itself, so a
rendered chat prompt starts with exactly one ``<s>`` whichever way it is encoded.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

DEFAULT_CORPUS = "/usr/share/games/fortunes"
MAX_DIR_BYTES = 25 * 1024 * 1024
SEED = 1234

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, END]  # ids 0..6 in this order
VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 1024

# Whitespace-insensitive: renders the same with plain jinja2 and with trim_blocks/lstrip_blocks.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% else %}"
    "{{ '<|user|>' }}"
    "{% endif %}"
    "{{ message['content'] }}{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# Files that are not English prose (pictures) or are tiny oddities.
SKIP_FILES = {"ascii-art"}

USER_PROMPTS = [
    "Tell me a fortune.",
    "Tell me a fortune",
    "Give me a fortune.",
    "Tell me something wise.",
    "Say something funny.",
    "Tell me a joke.",
    "What is my fortune?",
    "Share a quote.",
    "Can you tell me a fortune?",
    "Hello!",
    "Hi",
    "Tell me something.",
    "What do you think?",
    "Give me some advice.",
    "Say something clever.",
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a fortune cookie.",
    "You are a witty assistant that answers with fortunes.",
]


# --------------------------------------------------------------------------- corpus


def _apply_backspaces(text: str) -> str:
    """Resolve terminal overstriking (``_\\bX`` underlines, ``____\\b\\b\\b\\bword``)."""
    if "\b" not in text:
        return text
    out: list[str] = []
    for ch in text:
        if ch == "\b":
            if out and out[-1] != "\n":
                out.pop()
        else:
            out.append(ch)
    return "".join(out)


def _clean(record: str) -> str:
    record = _apply_backspaces(record)
    lines = [ln.rstrip() for ln in record.split("\n")]
    text = "\n".join(lines).strip("\n")
    return text


def _looks_like_prose(text: str) -> bool:
    if len(text) < 20 or len(text) > 2500:
        return False
    letters = sum(c.isalpha() for c in text)
    spaces = sum(c in " \n\t" for c in text)
    return letters / len(text) > 0.6 and (letters + spaces) / len(text) > 0.8


def load_corpus(corpus_dir: Path) -> list[tuple[str, int, str]]:
    """Return [(file, index_in_file, text)] for every usable fortune, in a fixed order."""
    if not corpus_dir.is_dir():
        raise SystemExit(
            f"error: fortunes corpus directory {corpus_dir} is missing.\n"
            "Install it with: apt-get update && apt-get install -y fortunes\n"
            "or pass --corpus DIR pointing at a directory of %-separated fortune files."
        )
    records: list[tuple[str, int, str]] = []
    for path in sorted(corpus_dir.iterdir()):
        name = path.name
        if path.is_dir() or path.is_symlink() or "." in name or name in SKIP_FILES:
            continue  # .dat indexes, .u8 symlinks, the offensive subfolder (off/), pictures
        raw = path.read_bytes().decode("utf-8", errors="replace")
        for i, rec in enumerate(re.split(r"^%\s*$", raw, flags=re.M)):
            text = _clean(rec)
            if _looks_like_prose(text):
                records.append((name, i, text))
    if len(records) < 1000:
        raise SystemExit(f"error: only {len(records)} usable fortunes found under {corpus_dir}; is this the fortunes corpus?")
    return records


def split_heldout(records, n_heldout: int = 64):
    rng = random.Random(SEED)
    idx = list(range(len(records)))
    rng.shuffle(idx)
    held = set(idx[:n_heldout])
    train = [r for i, r in enumerate(records) if i not in held]
    heldout = [records[i] for i in sorted(held)]
    return train, heldout


def write_heldout(heldout, path: Path) -> None:
    """Fortune-file format: records separated by '%' lines; each record starts with '@ file:index'."""
    parts = [
        "# Held-out fortunes (not trained on). Records are separated by lines holding only '%'.\n"
        "# The first line of each record is '@ <fortune file>:<record index in that file>'.\n"
    ]
    for name, i, text in heldout:
        parts.append(f"%\n@ {name}:{i}\n{text}\n")
    path.write_text("".join(parts))


def read_heldout(path: Path) -> list[str]:
    """Parse heldout.txt back into the fortune texts."""
    texts = []
    for rec in re.split(r"^%\n", path.read_text(), flags=re.M)[1:]:
        lines = rec.rstrip("\n").split("\n")
        assert lines[0].startswith("@ "), lines[0]
        texts.append("\n".join(lines[1:]))
    return texts


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    # No post-processor: BOS is added per tokenizer_config.json's add_bos_token (and by the chat template).
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT, END],
    }


def render_chat(messages, add_generation_prompt: bool) -> str:
    import jinja2

    return jinja2.Environment().from_string(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=BOS, eos_token=EOS
    )


# --------------------------------------------------------------------------- data


def make_documents(train, rng: random.Random, chat_fraction: float = 0.35) -> list[str]:
    """One epoch of training documents: plain '<s>fortune</s>' or a chat exchange ending '<|end|></s>'."""
    docs = []
    for _name, _i, text in train:
        if rng.random() < chat_fraction:
            msgs = []
            if rng.random() < 0.3:
                msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            msgs.append({"role": "user", "content": rng.choice(USER_PROMPTS)})
            msgs.append({"role": "assistant", "content": text})
            docs.append(render_chat(msgs, add_generation_prompt=False) + EOS)
        else:
            docs.append(BOS + text + EOS)
    rng.shuffle(docs)
    return docs


def pack(tok, docs: list[str], seq_len: int):
    import torch

    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len), len(ids)


# --------------------------------------------------------------------------- model


def make_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=MODEL_MAX_LENGTH,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        architectures=["LlamaForCausalLM"],
    )



def heldout_loss(model, tok, texts: list[str]) -> float:
    """Mean next-token loss (nats/token) over '<s>text</s>' for each held-out fortune."""
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for text in texts:
            ids = tok.encode(BOS + text + EOS, add_special_tokens=False).ids[:MODEL_MAX_LENGTH]
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum")
            total += loss.item()
            count += len(ids) - 1
    return total / count


def generate_samples(model_dir: Path, seed: int = 0) -> dict:
    """Load what was saved (bf16) with transformers + tokenizers and generate demo text."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    end_ids = [tok.token_to_id(EOS), tok.token_to_id(END)]
    out = {"greedy": [], "chat": []}
    with torch.no_grad():
        for prompt in ["The meaning of life is", "Once upon a time", "A computer is", "Love is"]:
            ids = torch.tensor([tok.encode(BOS + prompt, add_special_tokens=False).ids])
            gen = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=end_ids, pad_token_id=0)
            out["greedy"].append((prompt, tok.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True)))
        torch.manual_seed(seed)
        for question in ["Tell me a fortune.", "Give me some advice.", "What is the meaning of life?"]:
            prompt = render_chat([{"role": "user", "content": question}], add_generation_prompt=True)
            ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
            gen = model.generate(
                ids, max_new_tokens=60, do_sample=True, temperature=0.8, top_k=0, top_p=1.0,
                eos_token_id=end_ids, pad_token_id=0,
            )
            out["chat"].append((question, tok.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True)))
    return out


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def copyright_note() -> str:
    path = Path("/usr/share/doc/fortunes/copyright")
    if not path.is_file():
        return "The Debian copyright file (/usr/share/doc/fortunes/copyright) was not available when this model was built."
    text = path.read_text(errors="replace")
    bsd = "BSD copyright" in text
    return (
        "The training text is the fortune cookie database from Debian's `fortunes` package "
        "(BSD fortune-mod; /usr/share/games/fortunes, offensive fortunes not included). "
        "Debian's copyright file (/usr/share/doc/fortunes/copyright) says the program "
        + ("falls under the BSD copyright (Copyright (c) 1991 The Regents of the University of California; "
           "3-clause BSD licence: redistribution with or without modification permitted provided the copyright "
           "notice and disclaimer are retained and the University's name is not used for endorsement) "
           if bsd else "is distributed under the terms given there ")
        + "and names the origins of individual data files (e.g. the `cookie` file is from Karl Lehenbauer's "
        "postings to alt.sources). The fortunes themselves are short quotations from many authors; they are not "
        "all public domain, and this model is shipped only as a tiny demo/test fixture, not for reproducing them."
    )


def write_readme(out: Path, info: dict, samples: dict) -> None:
    s = []
    s.append("# pdserve built-in demo model\n")
    s.append(
        "A tiny Llama-architecture causal LM that ships inside pdserve so `pdserve generate --model builtin` and "
        "`pdserve up --model builtin` work offline. It writes English-looking (and often silly) text. "
        "It is a test/demo fixture, not a useful language model.\n"
    )
    s.append("Reproduce with `python -m pdserve.builtin.train --out pdserve/builtin/model` "
             f"(`--minutes {info['minutes']:g}` was used; CPU, 1 thread, seed {SEED}). "
             "Because the step count is derived from wall time, a rerun on another machine gives a different "
             "step count and weights unless `--steps` is given.\n")
    s.append("## Corpus\n")
    s.append(f"- Debian package `fortunes` {info['corpus_version']}, files under `{info['corpus_dir']}` "
             "(records separated by `%` lines). Skipped: `.dat` index files, `.u8` symlinks, any subfolder "
             f"(offensive fortunes live in `off/`, not installed), {sorted(SKIP_FILES)} (pictures), records that "
             "are not mostly letters/whitespace or are shorter than 20 / longer than 2500 characters. "
             "Terminal overstriking (backspaces) is resolved.\n")
    s.append(f"- {info['n_records']} fortunes used; {info['n_heldout']} held out (seeded shuffle, never trained on) "
             "and written to `heldout.txt`; the rest are the training set.\n")
    s.append(f"- Each epoch wraps ~35% of fortunes in the chat template (user asks e.g. \"Tell me a fortune.\", the "
             "assistant answers with the fortune, sometimes after a system message); the rest are plain "
             "`<s>fortune</s>` text. Documents are packed into sequences of "
             f"{info['seq_len']} tokens ({info['tokens_per_epoch']} tokens per epoch).\n")
    s.append("## Tokenizer\n")
    s.append(f"- Byte-level BPE trained with `tokenizers` on the training fortunes, vocabulary {info['vocab_size']} "
             f"including special tokens {SPECIAL_TOKENS} (ids 0..{len(SPECIAL_TOKENS) - 1}).\n")
    s.append("- BOS: `tokenizer.json` has **no** post-processor; `tokenizer_config.json` has `add_bos_token: true`, "
             "so callers prepend `<s>` (pdserve's Tokenizer wrapper does, unless the text already starts with "
             "`<s>`). The chat template emits `{{ bos_token }}` itself; encode rendered chat prompts without adding "
             "another BOS (or with pdserve's wrapper, which does not double it).\n")
    s.append("- Chat format (no newlines): `<s><|system|>SYSTEM<|end|><|user|>USER<|end|><|assistant|>REPLY<|end|>`; "
             "with `add_generation_prompt` the prompt ends with `<|assistant|>`. Other roles render as `<|user|>`.\n")
    s.append("- Stop tokens: `generation_config.json` `eos_token_id` = [`</s>`, `<|end|>`] "
             f"= {info['eos_ids']}; `bos_token_id` = {info['bos_id']}.\n")
    s.append("## Architecture\n")
    c = info["config"]
    s.append(f"- `LlamaForCausalLM`: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
             f"{c['num_attention_heads']} attention heads, {c['num_key_value_heads']} KV heads (GQA), head dim "
             f"{c['hidden_size'] // c['num_attention_heads']}, intermediate {c['intermediate_size']} (SiLU), "
             f"RMSNorm eps {c['rms_norm_eps']}, RoPE theta {info['rope_theta']:g}, max positions "
             f"{c['max_position_embeddings']}, untied input/output embeddings.\n")
    s.append(f"- Parameters: {info['n_params']:,}. Stored as bfloat16 in a single `model.safetensors` "
             f"({info['weights_bytes'] / 1e6:.1f} MB); whole directory {info['dir_bytes'] / 1e6:.1f} MB.\n")
    s.append("## Training\n")
    s.append(f"- Random init (seed {SEED}), AdamW (lr {info['lr']:g}, betas (0.9, 0.95), weight decay 0.1), "
             f"{info['warmup']} warmup steps then cosine decay to 10%, grad clip 1.0, batch {info['batch']} x "
             f"{info['seq_len']} tokens, fp32 weights "
             + ("with bfloat16 autocast " if info["amp"] else "")
             + f"on CPU with `torch.set_num_threads({info['threads']})`.\n")
    s.append(f"- {info['steps']} steps ({info['steps'] * info['batch'] * info['seq_len']:,} tokens, "
             f"{info['epochs']:.2f} epochs) in {info['train_seconds'] / 60:.1f} minutes (the step count is fixed from the "
             "speed of steps 3-13; a machine that gets busier later makes the run take longer than --minutes).\n")
    s.append(f"- Final training loss (mean of last 20 steps): {info['final_loss']:.3f} nats/token.\n")
    s.append(f"- Held-out loss (bfloat16 weights, `<s>fortune</s>` per held-out record): "
             f"{info['heldout_loss']:.3f} nats/token (uniform over the vocabulary would be ln {info['vocab_size']} "
             f"= {math.log(info['vocab_size']):.2f}).\n")
    s.append("## Samples\n")
    s.append("Loaded back with `transformers.AutoModelForCausalLM` (bf16) and `tokenizers.Tokenizer.from_file`.\n")
    s.append("Greedy, 40 new tokens:\n")
    for prompt, text in samples["greedy"]:
        s.append(f"```\n{prompt}|{text}\n```\n")
    s.append("Chat template, sampled at temperature 0.8 (torch seed 0), up to 60 new tokens:\n")
    for q, text in samples["chat"]:
        s.append(f"```\nuser: {q}\nassistant: {text}\n```\n")
    s.append("## License\n")
    s.append(copyright_note() + "\n")
    (out / "README.md").write_text("\n".join(s))


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.builtin.train", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output model directory")
    ap.add_argument("--corpus", type=Path, default=Path(DEFAULT_CORPUS), help=f"fortunes directory (default {DEFAULT_CORPUS})")
    ap.add_argument("--minutes", type=float, default=15.0, help="training wall time budget (default 15)")
    ap.add_argument("--steps", type=int, default=None, help="fixed number of steps (overrides --minutes)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-amp", dest="amp", action="store_false",
                    help="train in plain fp32 (default: fp32 weights with bfloat16 autocast, ~1.7x faster on CPU)")
    args = ap.parse_args(argv)

    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    random.seed(SEED)

    records = load_corpus(args.corpus)
    train, heldout = split_heldout(records)
    print(f"corpus: {len(records)} fortunes, {len(train)} train, {len(heldout)} held out", flush=True)

    tok = train_tokenizer([t for _, _, t in train])
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    print(f"tokenizer: vocab {vocab_size}", flush=True)

    config = make_config(vocab_size)
    model = LlamaForCausalLM(config)
    model.float().train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    warmup = 30

    data_rng = random.Random(SEED + 1)
    epoch, chunks, perm, pos, tokens_per_epoch = 0, None, None, 0, 0

    def next_batch():
        nonlocal epoch, chunks, perm, pos, tokens_per_epoch
        if chunks is None or pos + args.batch > len(perm):
            chunks, tokens_per_epoch = pack(tok, make_documents(train, data_rng), args.seq_len)
            perm = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(SEED + epoch))
            pos = 0
            epoch += 1
        b = chunks[perm[pos : pos + args.batch]]
        pos += args.batch
        return b

    total_steps = args.steps  # None until estimated from the first steps' speed
    budget = args.minutes * 60.0
    losses: list[float] = []
    t0 = time.time()
    step = 0
    while True:
        if total_steps is None and step == 3:
            t3 = time.time()  # the first steps are slower (allocator and kernel warm-up)
        if total_steps is None and step == 13:
            per_step = (time.time() - t3) / 10
            total_steps = max(step + 1, step + int((budget - (time.time() - t0)) / per_step))
            print(f"{per_step:.2f} s/step -> {total_steps} steps for {args.minutes:g} min", flush=True)
        if total_steps is not None and step >= total_steps:
            break
        horizon = total_steps or 10**6
        if step < warmup:
            lr = args.lr * (step + 1) / warmup
        else:
            frac = min(1.0, (step - warmup) / max(1, horizon - warmup))
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = next_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
            loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 20 == 0 or step == 1:
            el = time.time() - t0
            print(f"step {step}/{total_steps or '?'} loss {sum(losses[-20:]) / len(losses[-20:]):.3f} lr {lr:.2e} {el / 60:.1f} min", flush=True)
    train_seconds = time.time() - t0

    # ---- save
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.is_file():
            p.unlink()
    model.eval()
    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=[tok.token_to_id(EOS), tok.token_to_id(END)],
        pad_token_id=tok.token_to_id(PAD),
    )
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg.setdefault("torch_dtype", "bfloat16")  # transformers 5 writes "dtype"; older readers look for torch_dtype
    cfg.setdefault("dtype", "bfloat16")
    # transformers 5 nests this under rope_parameters; keep the classic top-level key for other readers.
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    write_heldout(heldout, out / "heldout.txt")
    (out / "model.safetensors").chmod(0o644)
    assert [t for _, _, t in heldout] == read_heldout(out / "heldout.txt")

    hl = heldout_loss(model, tok, [t for _, _, t in heldout])
    print(f"held-out loss (bf16): {hl:.3f}", flush=True)
    samples = generate_samples(out)
    for p, t in samples["greedy"]:
        print(f"[greedy] {p}|{t}")
    for q, t in samples["chat"]:
        print(f"[chat] {q} -> {t}")

    corpus_version = "(version unknown)"
    try:
        import subprocess

        corpus_version = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", "fortunes"], capture_output=True, text=True, check=True
        ).stdout.strip() or corpus_version
    except Exception:
        pass
    info = {
        "minutes": args.minutes, "corpus_dir": str(args.corpus), "corpus_version": corpus_version,
        "n_records": len(records), "n_heldout": len(heldout), "seq_len": args.seq_len,
        "tokens_per_epoch": tokens_per_epoch, "vocab_size": vocab_size,
        "eos_ids": [tok.token_to_id(EOS), tok.token_to_id(END)], "bos_id": tok.token_to_id(BOS),
        "config": config.to_dict(), "n_params": n_params, "rope_theta": cfg["rope_theta"],
        "weights_bytes": (out / "model.safetensors").stat().st_size, "dir_bytes": 0,
        "lr": args.lr, "warmup": warmup, "amp": args.amp, "batch": args.batch, "threads": args.threads,
        "steps": step, "epochs": step * args.batch * args.seq_len / max(1, tokens_per_epoch),
        "train_seconds": train_seconds, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "heldout_loss": hl,
    }
    write_readme(out, info, samples)
    info["dir_bytes"] = dir_size(out)
    write_readme(out, info, samples)  # again, with the final directory size
    size = dir_size(out)
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "README.md", "heldout.txt"}
    missing = expected - {p.name for p in out.iterdir()}
    assert not missing, f"missing files in {out}: {missing}"
    assert size <= MAX_DIR_BYTES, f"{out} is {size} bytes, over the {MAX_DIR_BYTES} byte limit"
    print(f"saved {out} ({size / 1e6:.2f} MB), {step} steps in {train_seconds / 60:.1f} min, "
          f"final loss {info['final_loss']:.3f}, held-out {hl:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
