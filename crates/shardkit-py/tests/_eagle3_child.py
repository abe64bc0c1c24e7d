"""What the EAGLE-3 producer tests share, and a producing process: a tiny seeded Llama-style
causal LM built from a config, a word-level tokenizer built in memory with a chat template
(with or without {% generation %} marks; both render the same text), and seeded chat samples.
Run as a script it produces the cache of those samples into ARGV[1] with the launcher's
RANK/WORLD_SIZE, printing `batch K` as each batch is written (a kill point) and `status ...`
at the end."""

import json
import random
import sys
import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = ("the a cat dog sat on mat is big small red blue what who why how yes no hello world "
         "run fast slow up down").split()
SEQ = 24

# One intra-op thread: on a small shared machine, more spin and make a tiny forward take
# seconds; every process of the tests (the entry point's through OMP_NUM_THREADS) uses the same
# count, which is also what keeps their floating-point sums in the same order.
torch.set_num_threads(1)

# The same text twice: the second marks each assistant turn (role token to <|end|>) for the
# tokenizer's own assistant mask; the first leaves the mask to the prefix renders.
PLAIN = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
         "{% if add_generation_prompt %}<|assistant|> {% endif %}")
GENERATION = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
              "{% generation %}<|assistant|> {{ m['content'] }} <|end|>{% endgeneration %} "
              "{% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def tokenizer(template=PLAIN):
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=SPECIAL[4:])
    fast.chat_template = template
    return fast


def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=16, intermediate_size=32,
                      num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=64, pad_token_id=3, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def samples(n=11):
    """Seeded conversations of 1-2 turns (some with a system message), the last longer than
    SEQ tokens (truncated, as NeMo truncates)."""
    rng = random.Random(5)

    def text(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    out = []
    for i in range(n - 1):
        msgs = [{"role": "system", "content": text(2)}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            msgs += [{"role": "user", "content": text(rng.randint(1, 3))},
                     {"role": "assistant", "content": text(rng.randint(1, 4))}]
        out.append({"messages": msgs})
    out.append({"messages": [{"role": "user", "content": text(8)}, {"role": "assistant", "content": text(30)}]})
    return out


KW = dict(seq_length=SEQ, draft_vocab_size=12, dtype="bf16", target_probs_topk=0, shard_size=4, batch_size=2,
          target_model="tiny-llama", input_data="seeded", buffers=2)


def produce(out, pause=0.0, **kw):
    from shardkit.precompute_eagle3 import precompute

    k = 0

    def progress(done, total, nbytes):
        nonlocal k
        k += 1
        print(f"batch {k} {done}/{total}", flush=True)
        time.sleep(pause)  # (on the writer thread) so that a kill at this line lands before the next

    return precompute(model(), tokenizer(), samples(), out, progress=progress, **{**KW, **kw})


if __name__ == "__main__":
    print("status " + json.dumps(produce(sys.argv[1], pause=0.3)), flush=True)
