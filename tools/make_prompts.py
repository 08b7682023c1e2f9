"""Writes src/eagle3_extract/assets/prompts/{train,heldout}.jsonl: single-turn chat prompts
for the drafter check (train on one set of topics, measure acceptance on other topics).

Deterministic: topics x tasks, no randomness; rerun to regenerate the committed files.

    python3 tools/make_prompts.py                     # the committed 480 + 160
    python3 tools/make_prompts.py --large OUT.jsonl   # 20,000+ for the GPU learning curve

`--large` (issue 28) crosses MORE_TOPICS (the train topics and 240 others, none of the
held-out ones) with MORE_TASKS, in an order that interleaves topics, so that the first N
rows of the file (the curve's 480, 2k, 5k) cover many topics each. Not committed: it is
a pure function of this file, written where it is used.
"""

import argparse
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

MORE_TOPICS = TRAIN_TOPICS + [
    "DNA", "evolution", "cells", "bacteria", "viruses", "antibiotics", "the brain",
    "memory", "dreams", "nutrition", "vitamins", "exercise", "yoga", "stretching",
    "marathons", "cycling", "football", "basketball", "tennis", "the Olympics",
    "the Sun", "comets", "asteroids", "Jupiter", "the Milky Way", "telescopes",
    "satellites", "rockets", "the International Space Station", "astronauts",
    "atoms", "molecules", "chemical reactions", "acids and bases", "the periodic table",
    "plastics", "recycling", "composting", "renewable energy", "nuclear power",
    "batteries", "hydrogen fuel", "oil refining", "natural gas", "coal",
    "rivers", "oceans", "lakes", "mountains", "caves", "islands", "weather forecasts",
    "clouds", "lightning", "snow", "hurricanes", "droughts", "floods", "wildfires",
    "forests", "grasslands", "wetlands", "soil", "fungi", "mushrooms", "trees", "flowers",
    "seeds", "photosynthesis in algae", "insects", "ants", "butterflies", "spiders",
    "birds", "eagles", "penguins", "parrots", "fish", "sharks", "octopuses", "frogs",
    "snakes", "turtles", "elephants", "lions", "wolves", "horses", "cows", "bats",
    "dinosaurs", "fossils", "ancient Greece", "ancient China", "the Maya", "the Vikings",
    "the Middle Ages", "castles", "knights", "the Industrial Revolution", "steam engines",
    "railways", "the telegraph", "the telephone", "radio", "television", "cinema",
    "photography", "painting", "sculpture", "architecture", "bridges", "skyscrapers",
    "roads", "cities", "villages", "maps", "compasses", "navigation", "sailing",
    "airplanes", "helicopters", "trains", "bicycles", "traffic lights", "public transport",
    "money", "banks", "credit cards", "taxes", "insurance", "investing", "saving for retirement",
    "small businesses", "marketing", "advertising", "supply chains", "shipping containers",
    "trade", "economics", "supply and demand", "unemployment", "universal basic income",
    "elections", "parliaments", "constitutions", "human rights", "the United Nations",
    "law", "courts", "juries", "police", "firefighters", "hospitals", "nurses", "doctors",
    "dentists", "pharmacies", "first aid", "handwashing", "sleep hygiene", "stress",
    "happiness", "friendship", "families", "parenting", "schools", "homework",
    "universities", "libraries", "books", "novels", "fairy tales", "myths", "legends",
    "comics", "video games", "board games", "puzzles", "crosswords", "sudoku", "magic tricks",
    "music theory", "guitars", "drums", "orchestras", "opera", "rock music", "hip hop",
    "dance", "ballet", "theater", "movies", "animation", "cooking pasta", "making soup",
    "baking cookies", "chocolate", "cheese", "rice", "spices", "vegetables", "fruit",
    "apples", "bananas", "tomatoes", "potatoes", "pizza", "sushi", "breakfast",
    "food safety", "fermentation", "wine", "beer", "water purification", "plumbing",
    "electric circuits", "light bulbs", "LEDs", "lasers", "microscopes", "thermometers",
    "clocks", "calendars", "time zones", "leap years", "numbers", "prime numbers",
    "fractions", "percentages", "geometry", "triangles", "circles", "algebra", "calculus",
    "probability", "statistics", "averages", "graphs", "logic", "computers", "CPUs",
    "memory chips", "operating systems", "Linux", "programming", "variables in code",
    "functions in programming", "loops in programming", "object-oriented programming",
    "databases", "cloud computing", "cybersecurity", "encryption", "artificial intelligence",
    "machine learning", "neural networks", "robots", "self-driving cars", "3D printing",
    "smartphones", "social media", "online shopping", "search engines", "web browsers",
    "HTML", "CSS", "JavaScript", "APIs", "open source software", "code review",
    "debugging", "technical documentation", "project management", "teamwork", "leadership",
    "negotiating a salary", "writing a resume", "remote work", "productivity", "habits",
    "goal setting", "note taking", "reading faster", "critical thinking", "creativity",
]
MORE_TASKS = TASKS + [
    "Why does {t} matter?", "Describe the history of {t} briefly.",
    "What questions do people often ask about {t}?", "Compare {t} with something similar.",
    "Write a short dialogue between two friends about {t}.",
    "Summarize {t} in three bullet points.", "What would the world be like without {t}?",
    "Give a step-by-step explanation of {t}.", "Write a haiku about {t}.",
    "What are common mistakes beginners make with {t}?",
    "Explain {t} using an analogy.", "What is the future of {t}?",
    "Write a short story that involves {t}.", "What are five key terms related to {t}?",
    "How is {t} used in everyday life?", "Write a quiz question about {t} with its answer.",
    "Explain {t} to a grandparent.", "What skills help you understand {t}?",
    "Write a tweet about {t}.", "What is a surprising connection between {t} and music?",
    "Give me a fun fact about {t} and explain why it is true.",
    "What are the main parts of {t}?", "Write a limerick about {t}.",
    "Explain the science behind {t}.", "What careers involve {t}?",
    "How has {t} changed over the last hundred years?",
    "Write a motivational message inspired by {t}.",
    "What would a beginner's checklist for {t} look like?",
    "Describe {t} in exactly five sentences.", "What are the risks related to {t}?",
    "Explain {t} as if you were a pirate.", "Write a product description related to {t}.",
    "What is the simplest way to get started with {t}?", "Argue for and against {t}.",
    "Write a short news headline and lead sentence about {t}.",
    "What do experts disagree about regarding {t}?", "Explain {t} in two sentences.",
    "Write an acrostic poem about {t}.", "What tools or materials relate to {t}?",
    "Create a short lesson plan about {t}.", "What is one experiment that shows {t}?",
    "Describe a day in the life of someone who works with {t}.",
    "What books or resources would help someone learn about {t}?",
    "Explain {t} with a real-world example.", "What are the ethical questions around {t}?",
    "Write a riddle whose answer is {t}.", "Describe {t} using only simple words.",
    "What numbers or statistics describe {t}?", "How do different cultures see {t}?",
    "Write a thank-you note to {t}.", "Outline a short presentation about {t}.",
    "What would you ask an expert on {t}?",
]


def more_rows(topics=None, tasks=None):
    """Every (task, topic) once; topics interleaved so any prefix spans many of them."""
    topics = list(dict.fromkeys(topics or MORE_TOPICS))  # order kept, duplicates dropped
    tasks = tasks or MORE_TASKS
    held = set(HELDOUT_TOPICS) & set(topics)
    if held:
        raise ValueError(f"held-out topics in the large set: {sorted(held)}")
    for step in range(len(tasks)):  # pass `step` gives topic i the task (i + step) % T:
        for i, topic in enumerate(topics):  # each (topic, task) exactly once over the passes
            task = tasks[(i + step) % len(tasks)]
            yield {"messages": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": task.format(t=topic)}]}


def rows(topics):
    for task in TASKS:
        for topic in topics:
            yield {"messages": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": task.format(t=topic)}]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--large", type=Path, metavar="OUT.jsonl",
                    help="write the large set (MORE_TOPICS x MORE_TASKS) there instead")
    args = ap.parse_args()
    if args.large:
        args.large.parent.mkdir(parents=True, exist_ok=True)
        with open(args.large, "w") as f:
            for row in more_rows():
                f.write(json.dumps(row) + "\n")
        return
    out = Path(__file__).resolve().parents[1] / "src/eagle3_extract/assets/prompts"
    out.mkdir(parents=True, exist_ok=True)
    for name, topics in (("train", TRAIN_TOPICS), ("heldout", HELDOUT_TOPICS)):
        with open(out / f"{name}.jsonl", "w") as f:
            for row in rows(topics):
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
