"""Image tasks that install offline, for training and measuring the small vision model.

- digits: scikit-learn's bundled handwritten digits (1,797 8x8 greyscale images, UCI); a fixed
  seeded split keeps 20% of them held out. Question "What digit is this?", answer "7".
- words: a word drawn with Pillow's built-in font (size, position, ink and paper shades random)
  on a 168x42 canvas. Question "Read the word in the picture.", answer the word. Training and
  held-out renderings use different seeds (the same word list; `unseen_words` are never trained).

Each example is (PIL image, question, answer). Images go through the model's own preprocessing
(`cedlm.text.images.preprocess`), exactly as an image sent to the API does.
"""
from __future__ import annotations

import random

import numpy as np

DIGIT_QUESTION = "What digit is this?"
WORD_QUESTION = "Read the word in the picture."
WORD_CANVAS = (168, 42)

WORDS = """apple river house green water light stone bread chair table music paper night
dream cloud plant tiger horse mouse sugar money happy smile heart earth ocean storm
train plane truck clock phone glass salt honey lemon grape melon peach cream juice
sweet bright quiet young old small large north south east west snow rain wind fire
gold silver blue black white red pink brown road city town park school book story
word letter pencil window door floor wall roof garden forest field hill lake island
bird fish frog snake queen king child friend teacher doctor farmer baker dance song""".split()
WORDS = WORDS[:60]             # the reading task's vocabulary (the time budget sets its size)
UNSEEN_WORDS = "candle rocket violin pepper turtle basket butter castle".split()


def digits_split(seed: int = 0, held_out: float = 0.2):
    """(train, test) lists of (PIL image 8x8 RGB, label int) from sklearn's digits."""
    from PIL import Image
    from sklearn.datasets import load_digits
    d = load_digits()
    idx = np.random.default_rng(seed).permutation(len(d.target))
    n_test = int(round(len(idx) * held_out))

    def item(i):
        a = (d.images[i] * (255.0 / 16.0)).round().clip(0, 255).astype(np.uint8)
        return Image.fromarray(a, mode="L").convert("RGB"), int(d.target[i])
    return [item(i) for i in idx[n_test:]], [item(i) for i in idx[:n_test]]


def render_word(word: str, rng: random.Random):
    """A word on a WORD_CANVAS image: Pillow's built-in font, random size/offset/shades."""
    from PIL import Image, ImageDraw, ImageFont
    W, H = WORD_CANVAS
    paper = rng.randint(200, 255)
    ink = rng.randint(0, 70)
    if rng.random() < 0.3:                        # light text on a dark background
        paper, ink = 255 - paper, 255 - ink
    im = Image.new("RGB", (W, H), (paper,) * 3)
    draw = ImageDraw.Draw(im)
    for size in range(rng.randint(20, 28), 9, -1):
        font = ImageFont.load_default(size=size)
        x0, y0, x1, y1 = draw.textbbox((0, 0), word, font=font)
        if x1 - x0 <= W - 6 and y1 - y0 <= H - 4:
            break
    x = rng.randint(2, max(2, W - (x1 - x0) - 4)) - x0
    y = rng.randint(1, max(1, H - (y1 - y0) - 2)) - y0
    draw.text((x, y), word, fill=(ink,) * 3, font=font)
    return im


def word_examples(n: int, seed: int, words: list[str] = WORDS):
    """n (image, word) pairs, words cycled in a seeded order."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        w = words[rng.randrange(len(words))]
        out.append((render_word(w, rng), w))
    return out
