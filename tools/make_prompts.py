"""Writes src/eagle3_extract/assets/prompts/{train,heldout}.jsonl: single-turn chat prompts
for the drafter check (train on one set of topics, measure acceptance on other topics).

Deterministic: topics x tasks, no randomness; rerun to regenerate the committed files.
"""

import json
from pathlib import Path

TRAIN_TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes",
    "binary search", "recursion", "hash tables", "the stock market", "inflation",
    "vaccines", "the immune system", "climate change", "solar panels", "electric cars",
    "the Roman Empire", "the printing press", "democracy", "the human heart", "sleep",
    "coffee", "bread baking", "gardening", "chess", "the piano", "jazz music",
    "the Moon", "Mars", "earthquakes", "rainbows", "magnets", "gravity", "electricity",
    "the internet", "email", "passwords", "compound interest", "budgeting", "running",
    "meditation", "dogs", "cats", "bees", "whales", "rainforests", "deserts", "glaciers",
    "the Great Wall of China", "the pyramids of Egypt", "Shakespeare", "poetry",
    "public speaking", "job interviews", "time management", "learning a language",
    "Python lists", "SQL joins", "version control with git", "unit testing",
    "sorting algorithms",
]
HELDOUT_TOPICS = [
    "tides", "the Renaissance", "linked lists", "coral reefs", "wind turbines",
    "the lungs", "tea", "origami", "the violin", "Saturn", "tornadoes", "friction",
    "spreadsheets", "mortgages", "swimming", "owls", "the Amazon river", "Mozart",
    "negotiation", "regular expressions",
]
TASKS = [
    "Explain {t} in simple terms.",
    "What are three interesting facts about {t}?",
    "Write a short paragraph about {t} for a ten-year-old.",
    "What is the most common misconception about {t}?",
    "Give me a one-sentence summary of {t}.",
    "How would you teach a beginner about {t}?",
    "List the pros and cons of {t}.",
    "Write a four-line poem about {t}.",
]
SYSTEM = "You are a helpful assistant."


def rows(topics):
    for task in TASKS:
        for topic in topics:
            yield {"messages": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": task.format(t=topic)}]}


def main():
    out = Path(__file__).resolve().parents[1] / "src/eagle3_extract/assets/prompts"
    out.mkdir(parents=True, exist_ok=True)
    for name, topics in (("train", TRAIN_TOPICS), ("heldout", HELDOUT_TOPICS)):
        with open(out / f"{name}.jsonl", "w") as f:
            for row in rows(topics):
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
