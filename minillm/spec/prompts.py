"""Prompt set for speculative decoding: drafter training data and held-out benchmark prompts.

The target model (SmolLM2-135M-Instruct) answers :func:`training_prompts` to make
self-distillation data for the trained drafters, and :func:`benchmark_prompts` are the prompts
every drafter is measured on. Three kinds, because acceptance rates differ a lot between them:

* ``"chat"``: ordinary user questions (explain X, how do I Y, A versus B), templates x topics;
* ``"grounded"``: tasks whose answer copies from the input (summarise, rewrite, extract, answer
  from a passage; edit a Python snippet), over short invented passages and code written here;
* ``"free"``: free writing (stories, poems, letters, product descriptions), templates x subjects.

Held-out rule: every bank (topics, subjects, passages, snippets) is split once, by position:
every 5th item (index 4, 9, 14, ...) is reserved for the benchmark and never appears in a
training prompt, and benchmark prompts are built only from those reserved items. Templates and
instructions are shared; the content they are filled with is not. Everything is pure Python and
deterministic: the same ``seed`` gives the same training prompts, and the benchmark is fixed.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cache

KINDS = ("chat", "grounded", "free")
_HOLD_OUT_EVERY = 5
_BENCH_SEED = 20240601

# --------------------------------------------------------------------------------------------
# chat: templates x topics
# --------------------------------------------------------------------------------------------

_CHAT_MODIFIERS = ("", " Keep it brief.", " Explain it for a child.", " Answer in three sentences.",
                   " Give one everyday example.")

_CONCEPT_TEMPLATES = (
    "Explain {t} in simple terms.",
    "Give me a short introduction to {t}.",
    "What are common misconceptions about {t}?",
    "How would you explain {t} to someone who has never heard of it?",
    "What should a beginner know about {t}?",
    "Tell me three interesting facts about {t}.",
    "Why do people care about {t}?",
    "What are the key ideas behind {t}?",
)

_CONCEPTS = (
    # science
    "photosynthesis", "the water cycle", "black holes", "plate tectonics", "vaccines",
    "the greenhouse effect", "DNA", "static electricity", "the phases of the Moon",
    "evolution by natural selection", "sound waves", "rainbows",
    # cooking
    "fermentation in bread making", "the Maillard reaction", "umami", "food allergies",
    "emulsions like mayonnaise", "gluten",
    # programming
    "recursion", "version control with git", "object-oriented programming", "web APIs",
    "hash tables", "unit testing", "machine learning", "open-source software",
    "cloud computing", "regular expressions",
    # history
    "the French Revolution", "the Silk Road", "the printing press", "the Industrial Revolution",
    "the Roman Empire", "the Cold War", "the invention of the telephone",
    "the pyramids of ancient Egypt",
    # travel
    "jet lag", "travel insurance", "time zones", "the Schengen Area", "carbon offsets for flights",
    # health
    "sleep cycles", "dietary fibre", "blood pressure", "hydration", "mindfulness meditation",
    "the immune system",
    # money
    "compound interest", "inflation", "credit scores", "index funds", "household budgets",
    "mortgages", "pension savings",
    # sport
    "the offside rule in football", "interval training", "the Olympic Games",
    "the scoring system in tennis", "the rules of cricket", "muscle recovery",
    # everyday life
    "recycling", "tipping in restaurants", "composting", "energy labels on appliances",
    "online privacy", "small talk", "procrastination",
)

_TASK_TEMPLATES = (
    "How do I {t}?",
    "Give me some tips to {t}.",
    "What is the easiest way to {t}?",
    "What mistakes should I avoid when I try to {t}?",
    "I want to {t}. Where should I start?",
    "Can you give me a step-by-step plan to {t}?",
)

_TASKS = (
    "keep basil alive on a windowsill", "start running as a complete beginner",
    "save money on groceries", "make a good cup of coffee at home", "learn to touch type",
    "cook rice without it sticking", "write my first Python script",
    "plan a week of healthy lunches", "fall asleep faster", "prepare for a job interview",
    "pack light for a two-week trip", "get rid of fruit flies in the kitchen",
    "learn a new language as an adult", "make my passwords more secure",
    "keep a houseplant alive while I am on holiday", "clean a cast-iron pan",
    "stop putting off my homework", "start a vegetable garden on a balcony",
    "set up a monthly budget", "improve my posture at a desk", "make friends in a new city",
    "read more books", "teach a child to ride a bike", "debug a program that crashes",
    "bake bread without a bread machine", "reduce my screen time", "train for a 5k race",
    "find cheap flights", "choose a ripe watermelon", "remove a red wine stain",
    "back up the photos on my phone", "write a polite complaint email", "memorise a speech",
    "organise a small kitchen", "learn to swim as an adult", "keep my bike in good condition",
    "sharpen a kitchen knife", "start investing with a small amount of money",
    "find my way around a city I do not know", "stay motivated to exercise in winter",
    "make a simple tomato sauce", "learn the basics of chess", "get better at public speaking",
    "calm down before an exam", "cut down on sugar", "write code that others can read",
    "travel with a toddler", "sleep well on a long flight", "keep bread fresh for longer",
    "speed up a slow laptop",
)

_PAIR_TEMPLATES = (
    "What is the difference between {t}?",
    "Compare {t} in a short paragraph.",
    "How can I tell the difference between {t}?",
    "What do {t} have in common, and how do they differ?",
    "Explain the main differences between {t}.",
)

_PAIRS = (
    "baking soda and baking powder", "weather and climate", "a virus and a bacterium",
    "a list and a tuple in Python", "stocks and bonds", "a debit card and a credit card",
    "jogging and sprinting", "a crocodile and an alligator", "a simile and a metaphor",
    "RAM and disk storage", "a hurricane and a tornado", "butter and margarine",
    "Python and JavaScript", "a savings account and a current account",
    "a psychologist and a psychiatrist", "yoga and pilates", "a hostel and a hotel",
    "empathy and sympathy", "speed and velocity", "a republic and a monarchy",
    "a frog and a toad", "a latte and a cappuccino", "renting and buying a home",
    "aerobic and anaerobic exercise", "a compiler and an interpreter", "mass and weight",
    "a lake and a pond", "an ebook and a paper book", "a train and a plane for a 500 km trip",
    "rugby and American football", "a cold and the flu", "a mortgage and a personal loan",
    "green tea and black tea", "a comet and an asteroid", "a violin and a viola",
)

# --------------------------------------------------------------------------------------------
# free: templates x subjects
# --------------------------------------------------------------------------------------------

_FREE_MODIFIERS = ("", " Keep it under 100 words.", " Make it funny.",
                   " Make it suitable for young children.", " Use simple, clear language.")

_STORY_TEMPLATES = (
    "Write a short story about {t}.",
    "Tell me a bedtime story about {t}.",
    "Write the opening paragraph of a story about {t}.",
    "Write a very short story, about 150 words, about {t}.",
)

_STORIES = (
    "a lighthouse keeper who finds a message in a bottle", "a robot learning to bake bread",
    "a girl who can talk to the wind", "a lost dog finding its way home across a city",
    "an old man planting a tree he will never see grow", "a dragon who is afraid of fire",
    "two strangers stuck in a lift", "a town where it never stops snowing",
    "a cat who becomes mayor", "a boy who builds a boat from scrap wood",
    "the last bookshop on a busy street", "a time traveller stuck in the same Tuesday",
    "a chef who loses her sense of taste", "a family moving to a farm",
    "a penguin that wants to fly", "a detective solving the case of the missing cake",
    "a musician who plays for an empty square", "a child's first day at a new school",
    "a spaceship crew discovering a garden on Mars",
    "a grandmother teaching her grandson to fish", "a shy giant living in the mountains",
    "a letter delivered fifty years late", "a train that only runs at midnight",
    "a pair of shoes that walk by themselves", "a village that wakes up with no electricity",
    "an astronaut's last day on the space station", "a fox and a crow who become friends",
    "a painter who can only paint the sea", "a clock that runs backwards",
    "a kite caught in a tall oak tree",
)

_POEM_TEMPLATES = (
    "Write a poem about {t}.",
    "Write a haiku about {t}.",
    "Write a four-line rhyming poem about {t}.",
    "Write a free-verse poem about {t}.",
)

_POEMS = (
    "autumn rain", "the first day of spring", "a city at night", "an old wooden bench",
    "the ocean at dawn", "a cup of morning coffee", "an old friendship", "a snowy mountain village",
    "the sound of a distant train", "a grandmother's kitchen", "the stars over a desert",
    "a busy railway station", "losing a favourite umbrella", "the moon over a quiet lake",
    "a garden after a storm", "learning to ride a bicycle", "the smell of fresh bread",
    "a forgotten toy in the attic", "the long summer holidays", "a lighthouse in a storm",
    "missing home", "a cat asleep in the sun", "the last leaf on a tree",
    "a river meeting the sea", "a long walk home", "a thunderstorm in July",
    "an empty playground", "birdsong in the morning", "the colour blue",
    "a kettle coming to the boil",
)

_LETTER_TEMPLATES = (
    "Write a short letter to {t}.",
    "Write an email to {t}.",
    "Draft a polite message to {t}.",
    "Write a friendly note to {t}.",
)

_LETTERS = (
    "a neighbour, apologising for a noisy party", "your future self, ten years from now",
    "a teacher who changed your life", "a friend who has moved abroad",
    "your landlord, asking for a broken heater to be fixed",
    "the local council, asking for a new pedestrian crossing",
    "a shop, complaining about a late delivery", "your grandparents, describing your new job",
    "a pen pal in another country", "a company, applying for a summer job",
    "a hotel, thanking the staff for a lovely stay", "a new colleague, welcoming them to the team",
    "a children's author, saying how much you enjoyed their book",
    "your younger self on the first day of school",
    "a restaurant, asking about booking a birthday dinner",
    "a sports coach, thanking them at the end of the season",
    "the editor of a newspaper, about litter in the park", "a friend, inviting them to a picnic",
    "your manager, asking for a day off", "a museum, suggesting a new exhibition",
    "a neighbour, offering to water their plants while they are away",
    "a school, asking to visit before enrolling your child",
    "your landlord, giving notice that you will move out",
    "a friend, congratulating them on their new baby", "an airline, asking about lost luggage",
    "a volunteer group, offering to help at weekends",
    "a bookshop, asking them to order a rare book",
    "a mentor, asking for advice about changing careers",
)

_PRODUCT_TEMPLATES = (
    "Write a product description for {t}.",
    "Write a short advert for {t}.",
    "Write three catchy slogans for {t}.",
    "Write an online shop listing for {t}.",
)

_PRODUCTS = (
    "a solar-powered phone charger", "a water bottle that keeps drinks cold for a whole day",
    "a folding electric bike", "a handmade wool scarf", "a smart plant pot that waters itself",
    "noise-cancelling headphones for children", "a travel mug that never spills",
    "a board game about running a bakery", "a lightweight hiking tent",
    "a cookbook of ten-minute dinners", "an alarm clock that wakes you with light",
    "a waterproof notebook", "organic dog biscuits", "a kitchen scale that counts calories",
    "a wooden toy train set", "a desk lamp with a wireless charger",
    "a set of bamboo toothbrushes", "a language-learning app for busy adults",
    "a heated winter jacket", "a pocket-sized projector", "a compost bin for small flats",
    "running shoes made from recycled plastic", "a cat tree with a hammock",
    "a subscription box of local cheeses", "a mechanical keyboard for writers",
    "a pocket umbrella that survives strong wind", "a beginner's watercolour painting kit",
    "a smart doorbell with a camera",
)

_CHAT_FAMILIES = ((_CONCEPT_TEMPLATES, _CONCEPTS), (_TASK_TEMPLATES, _TASKS),
                  (_PAIR_TEMPLATES, _PAIRS))
_FREE_FAMILIES = ((_STORY_TEMPLATES, _STORIES), (_POEM_TEMPLATES, _POEMS),
                  (_LETTER_TEMPLATES, _LETTERS), (_PRODUCT_TEMPLATES, _PRODUCTS))

# --------------------------------------------------------------------------------------------
# grounded: instructions x passages, instructions x code snippets
# --------------------------------------------------------------------------------------------

_PASSAGE_TASKS = (
    "Summarise the passage in one sentence.",
    "Summarise the passage in two sentences.",
    "Write a short summary of the passage.",
    "Rewrite the passage in simpler words.",
    "Rewrite the passage so that a ten-year-old could understand it.",
    "Rewrite the passage using short, plain sentences.",
    "Rewrite the passage in a formal tone.",
    "Rewrite the passage as it might appear in an official report.",
    "List every person and place named in the passage.",
    "Extract all the dates and years in the passage as a list.",
    "Extract all the numbers in the passage as a bulleted list, saying what each one refers to.",
    "List the key facts in the passage.",
    "Turn the passage into bullet points.",
    "Turn the passage into three to five bullet points.",
    "Rewrite the passage as a numbered list of facts.",
    "Give the passage a title, then copy out its most important sentence.",
    "Rewrite the passage in the present tense.",
)

_QUESTION_TASKS = (
    "Answer this question using only the passage: {q}",
    "Using the passage, answer: {q} Quote the sentence that supports your answer.",
)

# (passage, a question the passage answers); every 5th one is held out for the benchmark.
_PASSAGES: tuple[tuple[str, str], ...] = (
    ("The town of Marrowby opened its first public library in 1892, in two rooms above a bakery "
     "on Mill Street. The collection began with 340 books donated by a retired schoolteacher "
     "named Edith Crane. By 1910 the library had outgrown the rooms and moved into a brick hall "
     "near the river. Today it holds more than 60,000 items and lends about 900 books a week.",
     "Who donated the first books to the library?"),
    ("Researchers from the Halden Institute spent the summer of 2019 counting freshwater mussels "
     "in Lake Oster. They surveyed 48 sites along the northern shore and found mussels at 31 of "
     "them. The densest bed, near the old ferry landing, held roughly 120 mussels per square "
     "metre. The team believes cool water from two mountain streams helps the mussels survive "
     "hot summers.",
     "At how many sites did the team find mussels?"),
    ("The Kestrel Bridge across the Varn estuary took four years to build and opened to traffic "
     "in March 1968. It is 1.4 kilometres long and carries two lanes in each direction. Its "
     "engineer, Tomas Reyel, chose a cable-stayed design because the soft riverbed could not "
     "support many piers. A footpath was added along the eastern side in 2003 after a local "
     "campaign.",
     "Why did the engineer choose a cable-stayed design?"),
    ("Every October the village of Pellham holds a lantern festival on the last Saturday of the "
     "month. Children spend the week before making lanterns from paper, wire and willow sticks. "
     "At dusk, around 2,000 people walk together from the church to the harbour, where the "
     "lanterns are hung on the fishing boats. The tradition was started in 1975 by a teacher who "
     "wanted to brighten the dark autumn evenings.",
     "Where do the lanterns end up at the end of the walk?"),
    ("Alma Vieira opened the Copper Oven bakery in the town of Serra Alta in 2011 with one oven "
     "and a single employee. Her sourdough starter came from her grandmother's farm and is said "
     "to be more than 50 years old. The bakery now employs 14 people and bakes about 800 loaves "
     "a day. In 2018 Vieira began running weekend classes for home bakers, which sell out months "
     "in advance.",
     "How many loaves does the bakery bake each day?"),
    ("The Sennor Valley Railway climbs 1,150 metres from the town of Brisk to the Alder Pass in "
     "just under an hour. Built between 1896 and 1901, it uses a toothed rack between the rails "
     "to grip the steep sections. The line closed in 1958 when a new road made it unprofitable. "
     "Volunteers reopened the upper half in 1994, and it now carries about 40,000 tourists each "
     "summer.",
     "Why did the railway close in 1958?"),
    ("In 2021 divers from the Marine Watch group surveyed 12 reefs off the coast of the island of "
     "Tamsa. They photographed each reef along a 50-metre line and later counted the living "
     "coral in the images. Living coral covered 38 percent of the seabed on average, down from "
     "45 percent in a similar survey in 2012. The reefs on the sheltered western side were in "
     "noticeably better condition.",
     "How did coral cover change between 2012 and 2021?"),
    ("The weather station on Mount Harrow has recorded temperature and wind every hour since "
     "1931. It was staffed by a single observer until 1987, when automatic instruments took "
     "over. The strongest gust on record, 196 kilometres per hour, was measured in January "
     "1974. The observers' handwritten logbooks, 56 volumes in all, are now kept at the "
     "regional archive in Dunmere.",
     "When did automatic instruments replace the observer?"),
    ("The Riverside Open chess tournament was first played in 1983 in a school gym with 22 "
     "players. It has since grown into a five-day event with more than 400 entrants from 30 "
     "countries. Each player has 90 minutes for the game, with 30 seconds added after every "
     "move. The 2023 edition was won by a 15-year-old, Mira Sandoval, who scored seven points "
     "from nine rounds.",
     "How many points did the 2023 winner score?"),
    ("Twelve beekeepers in the hill country around Orvin formed a cooperative in 2015 to share "
     "equipment and sell their honey together. Between them they keep about 340 hives. The "
     "cooperative bought a shared extracting machine, which cut the time needed to process a "
     "harvest from three weeks to five days. Its heather honey won a regional prize in 2020.",
     "What did the shared extracting machine change?"),
    ("After the river Tolley burst its banks in 2007 and flooded 600 homes in Wexley, the council "
     "built a flood wall along the town centre. The wall is 2.1 kilometres long and stands up to "
     "1.8 metres above the path. Removable steel panels close the gaps at the two bridges when "
     "the water rises. Since the wall was finished in 2012, the river has reached flood level "
     "four times without entering the town.",
     "How are the gaps at the bridges closed?"),
    ("The Ashgrove Mill was built in 1824 to spin cotton using power from a large water wheel. At "
     "its peak in the 1870s it employed around 700 workers, many of them children. The mill "
     "switched to steam power in 1881 and closed for good in 1962. Its restored wheel, 9 metres "
     "across, now turns again as part of a museum run by the Ashgrove Trust.",
     "How many people worked at the mill at its peak?"),
    ("The Linden Conservatory offers 25 full scholarships each year to young musicians who could "
     "not otherwise afford its fees. Applicants must be between 14 and 19 years old and play an "
     "orchestral instrument or the piano. Auditions take place in February, and results are "
     "sent by post in early April. The scheme was funded by a gift from the cellist Ruth "
     "Albrecht in 1999.",
     "How old must applicants be?"),
    ("A new electric ferry began crossing the Sund strait between Holmby and Skarre in May 2022. "
     "The boat carries up to 150 passengers and 30 cars and makes the 25-minute trip 18 times a "
     "day. Its batteries are recharged at each end during the ten minutes spent loading. The "
     "operator says the ferry uses about a third of the energy of the diesel boat it replaced.",
     "When are the ferry's batteries recharged?"),
    ("Scientists have measured the front of the Brenna Glacier every autumn since 1950. In that "
     "time the glacier has retreated by about 2.3 kilometres, most of it since 1990. A lake that "
     "did not exist in the 1950s now fills the valley the ice left behind. In 2016 the team "
     "added time-lapse cameras that take a photograph every three hours.",
     "What now fills the valley the ice left behind?"),
    ("Two students, Priya Nair and Jonas Feld, built the meal-planning app Pantryful in 2020 "
     "while sharing a flat in Leeds. The app suggests recipes based on what is already in the "
     "user's cupboards and flags food that is about to go out of date. It reached 100,000 users "
     "in its first year without any paid advertising. By 2023 the company had 18 employees and "
     "a second office in Dublin.",
     "What does the app base its recipe suggestions on?"),
    ("The Alhambra Theatre in Corrow opened in 1909 and seated 1,200 people on three levels. It "
     "became a cinema in the 1950s and then stood empty for almost 20 years after 1986. A "
     "restoration costing 14 million pounds uncovered the original painted ceiling, which had "
     "been hidden behind plasterboard. The theatre reopened in September 2019 with a play by a "
     "local author.",
     "What did the restoration uncover?"),
    ("The Elm Street community garden was created in 2014 on a car park that had been empty for "
     "a decade. Volunteers removed the tarmac by hand over three weekends and brought in 80 "
     "tonnes of soil. The garden now has 46 small plots, a shared greenhouse and a tool shed. "
     "Around a quarter of the vegetables grown there are given to a nearby food bank.",
     "What was on the site before the garden?"),
    ("An amateur astronomer, Luis Ortega, spotted a faint smudge of light near the constellation "
     "Orion on 3 February 2024. Professional observatories confirmed within two days that it was "
     "a comet nobody had seen before. Calculations suggest it takes about 4,000 years to travel "
     "once around the Sun. It will pass closest to Earth in late 2025, but binoculars will "
     "probably be needed to see it.",
     "How long does the comet take to travel around the Sun?"),
    ("The Fernside Wildlife Rescue cares for about 3,000 injured animals a year, most of them "
     "birds and hedgehogs. It began in 1991 in the garage of a vet, Helen Marsh, and moved to a "
     "farm outside the village in 2001. Around 60 volunteers help with feeding, cleaning and "
     "driving animals to the centre. Roughly two thirds of the animals it takes in are later "
     "released back into the wild.",
     "Where did the rescue centre begin?"),
    ("Salt has been dug from the hills near Vorsk for at least 700 years. The mine reached its "
     "deepest point, 327 metres below the surface, in 1911. Miners carved a chapel out of the "
     "salt in one of the old chambers, complete with a salt altar and statues. The mine stopped "
     "commercial work in 1996 and now welcomes about 250,000 visitors a year.",
     "How deep is the deepest point of the mine?"),
    ("The city of Arlen launched a bicycle-sharing scheme in April 2017 with 500 bikes at 40 "
     "stations. Riders pay a small yearly fee and can use any bike free of charge for the first "
     "30 minutes. By 2022 the scheme had grown to 2,400 bikes, including 600 electric ones. The "
     "city says about 11,000 trips are made on a typical weekday.",
     "How long can riders use a bike without paying extra?"),
    ("The Hollin family has made cheese on their farm in the Dale valley since 1938. They use "
     "milk from their own herd of 90 cows and age the cheese in a cave dug into the hillside. "
     "Each wheel weighs about 20 kilograms and is turned by hand once a week for at least a "
     "year. The farm shop sells most of the cheese, and the rest goes to restaurants within 50 "
     "miles.",
     "Where is the cheese aged?"),
    ("The first Harbour City Marathon in 1979 had 160 runners, most of them members of local "
     "clubs. The course starts at the old customs house, crosses both river bridges and finishes "
     "in Victoria Gardens. The race now limits entries to 25,000 people and sells out in less "
     "than a day. The men's course record of 2 hours 7 minutes was set in 2015, and the women's "
     "record of 2 hours 21 minutes in 2019.",
     "Where does the course finish?"),
    ("The clock in the tower of Dunmere town hall was installed in 1868 by the clockmaker Samuel "
     "Pryce. Its four faces are each 2.5 metres wide and lit from behind at night. The mechanism "
     "was wound by hand twice a week until an electric motor was fitted in 1972. In 2018 a team "
     "of volunteers cleaned and repaired every gear, and the clock has kept time to within a few "
     "seconds since.",
     "How often was the clock wound before 1972?"),
    ("The Qasr solar farm in the desert south of the town of Ramil began producing electricity "
     "in 2020. It covers 9 square kilometres with about two million panels that tilt to follow "
     "the Sun. Robots brush the dust from the panels every night without using any water. On a "
     "sunny day the farm can supply enough electricity for around 400,000 homes.",
     "How are the panels cleaned?"),
    ("The typeface Marlowe was designed by Ines Kaur in 2009 for a small publisher of children's "
     "books. She wanted letters that new readers could tell apart easily, so the lowercase a and "
     "g have simple single-storey shapes. The font was released for free in 2012 and is now used "
     "by more than 200 schools. Kaur later added Greek and Cyrillic letters after requests from "
     "teachers abroad.",
     "Why do the letters a and g have simple shapes?"),
    ("The Northfield Robotics Challenge invites teams of secondary school students to build a "
     "robot in six weeks. This year the task was to sort coloured blocks into bins while "
     "avoiding obstacles. Thirty-two teams took part, and each robot had three timed attempts. "
     "The winning team, from Greywell School, sorted 41 blocks in two minutes with a robot built "
     "mostly from recycled parts.",
     "How many blocks did the winning robot sort?"),
    ("The Casteln vineyard sits on a steep south-facing slope above the river Mour. Its vines "
     "were planted in 1962 by Giulia and Marco Ferro, who terraced the hillside with stone "
     "walls. The grapes are picked by hand each September because the slope is too steep for "
     "machines. The vineyard produces about 30,000 bottles a year, mostly of a dry white wine.",
     "Why are the grapes picked by hand?"),
    ("Until the 1960s almost every family in Porthwen earned its living by fishing for herring. "
     "When the herring shoals moved away, the village fleet shrank from 70 boats to fewer than "
     "ten. Many of the old net lofts have since been turned into holiday cottages and galleries. "
     "A small museum in the former lifeboat station tells the story of the fishing years.",
     "What happened to the old net lofts?"),
    ("In 1853 a surveying party led by Captain Arthur Lowe spent eight months mapping the coast "
     "of the Skerry Islands. The twelve men measured angles with brass instruments and recorded "
     "depths by lowering a weighted line. Their charts showed 214 islands, far more than earlier "
     "maps. Ships used the charts for almost a century before they were replaced in 1949.",
     "How many islands did the charts show?"),
    ("The Orla Observatory's main telescope has a mirror 3.6 metres across and stands at an "
     "altitude of 2,400 metres. It opened in 1985 and was given a new camera in 2017. The camera "
     "can photograph a patch of sky as large as the full Moon in a single image. Astronomers "
     "from eight countries share the observing time, which is handed out twice a year.",
     "How often is observing time handed out?"),
    ("The Saturday market in Tolbridge has been held in the town square since a royal charter "
     "was granted in 1304. Around 90 stalls sell fruit, vegetables, bread, cheese, flowers and "
     "second-hand books. In 2016 the council banned cars from the square on market days, and the "
     "number of visitors rose by about a fifth. Traders pay 25 pounds for each day's pitch.",
     "What happened after cars were banned from the square?"),
    ("Every spring around 15,000 cranes stop at the Marsh of Helm on their way north. They "
     "arrive in the middle of March and stay for two to three weeks, feeding on the wet fields. "
     "Local farmers are paid to leave part of their harvest on the ground for the birds. Ringing "
     "studies have shown that some cranes return to the same fields year after year.",
     "What are the local farmers paid to do?"),
    ("The Brightwater Language School teaches English to about 600 adults each year, most of "
     "them recent arrivals in the city. Classes are held in the evenings and on Saturdays so "
     "that students can attend around their jobs. The school has 35 teachers, more than half of "
     "them volunteers. A childcare room, opened in 2019, lets parents of young children attend "
     "lessons.",
     "Why are classes held in the evenings and on Saturdays?"),
    ("A clinic for sports injuries opened at St Anne's Hospital in Corrow in January 2023. It "
     "offers physiotherapy, X-rays and a doctor's advice in a single visit, so patients no "
     "longer need three separate appointments. The clinic sees around 120 patients a week. "
     "Waiting times for a first appointment have fallen from six weeks to about ten days.",
     "How have waiting times changed?"),
    ("The Valen Youth Orchestra toured South America for the first time in the summer of 2022. "
     "Its 85 musicians, aged between 16 and 24, gave 11 concerts in five countries over three "
     "weeks. The programme included a new piece by the composer Daniel Oyelaran, written for the "
     "tour. The players paid for part of the trip themselves, raising money by busking for a "
     "year.",
     "How many concerts did the orchestra give?"),
    ("Hartwell Park was laid out in 1851 on land given to the town by a wealthy brewer, George "
     "Hartwell. It covers 34 hectares and includes a boating lake, a bandstand and a walled rose "
     "garden. During the Second World War part of the park was dug up to grow vegetables. A cafe "
     "in the old boathouse, opened in 2010, is now one of the busiest in the town.",
     "Who gave the land for the park?"),
    ("The cargo ship Morning Star sank in a storm off Gull Point in November 1887 while carrying "
     "coal and china plates. All 19 crew were rescued by the local lifeboat, whose crew rowed "
     "out three times in the dark. The wreck lies in 22 metres of water and is popular with "
     "divers. Pieces of the china still wash up on the beach after winter storms.",
     "How many crew members were rescued?"),
    ("Since 2018 every pupil at Farrow Primary School has spent one afternoon a week learning "
     "outdoors in a nearby wood. The children build shelters, identify plants and write stories "
     "inspired by what they find. Teachers report that attendance on the outdoor afternoons is "
     "higher than on other days. The school now trains staff from other schools that want to "
     "start similar programmes.",
     "What do the children do in the wood?"),
    ("The observatory on the slopes of Mount Ketra has watched the volcano since its last "
     "eruption in 1979. Instruments around the crater measure small earthquakes, ground movement "
     "and the gases escaping from vents. When the readings rose sharply in 2021, the alert level "
     "was raised and 3,000 residents were told to prepare to leave. The volcano calmed down "
     "after two months without erupting.",
     "What do the instruments around the crater measure?"),
    ("In 1931 a tailor named Oskar Lind patented a folding umbrella that fitted into a coat "
     "pocket. His design used a telescopic handle and ribs that folded in two places. Lind sold "
     "the rights to a manufacturer in 1934 for 5,000 crowns, a large sum at the time. The "
     "company went on to sell millions of the umbrellas, though Lind earned nothing more from "
     "them.",
     "How much did Lind sell the rights for?"),
    ("The town of Bexmoor started collecting food waste from homes in 2016. Each household was "
     "given a small kitchen caddy and a larger bin that is emptied every week. The waste goes to "
     "a plant that turns it into gas for electricity and into fertiliser for farms. In the first "
     "year the amount of rubbish sent to landfill fell by 18 percent.",
     "What is the food waste turned into?"),
    ("The Glen Arrow sheepdog trials have been held every August since 1873. Each handler has 15 "
     "minutes to guide a dog as it gathers five sheep from a distant hill and drives them into a "
     "small pen. Handlers may only use whistles and calls and must not touch the sheep. In 2022 "
     "a record 140 dogs competed over three days.",
     "How long does each handler have?"),
    ("The Kandor tea estate was planted in 1887 on hills 1,800 metres above sea level. About 400 "
     "workers pick the leaves by hand, taking only the top two leaves and a bud from each shoot. "
     "The leaves are withered, rolled and dried in a factory on the estate within a day of "
     "picking. The estate's tea is sold at auction in the capital every Tuesday.",
     "Which parts of each shoot are picked?"),
)

# (instruction, tag a snippet needs for it, "" for any snippet)
_CODE_TASKS = (
    ("Add type hints to this code.", ""),
    ("Add a docstring to this code.", ""),
    ("Rename the variables in this code to clearer, more descriptive names.", ""),
    ("Add a short comment to each line of this code.", ""),
    ("Add type hints and a docstring to this code, changing nothing else.", ""),
    ("Explain this code line by line, quoting each line before you explain it.", ""),
    ("Add input validation to this code that raises a ValueError for bad arguments.", ""),
    ("Rewrite this code to follow PEP 8 naming and spacing, keeping its behaviour.", ""),
    ("Convert the loop in this code into a list comprehension.", "loop"),
    ("Rewrite this function so its body is a single return of a list comprehension.", "loop"),
    ("This code has an off-by-one bug. Find it and show the fixed code.", "bug"),
    ("Fix the off-by-one error in this code and explain the fix in one sentence.", "bug"),
    ("Translate the comments in this code into French.", "comments"),
    ("Translate the comments in this code into Spanish.", "comments"),
    ("Translate the comments in this code into German.", "comments"),
)

# (tags, code): tags say which tagged tasks fit; every 5th snippet is held out.
_SNIPPETS: tuple[tuple[str, str], ...] = (
    ("loop", """
def squares(numbers):
    result = []
    for n in numbers:
        result.append(n * n)
    return result
"""),
    ("bug comments", """
def last_items(items, k):
    # return the last k items of the list
    out = []
    for i in range(len(items) - k, len(items) - 1):
        out.append(items[i])
    return out
"""),
    ("comments", """
def count_vowels(text):
    # count how many vowels appear in the text
    count = 0
    for ch in text.lower():
        if ch in "aeiou":
            count += 1
    return count
"""),
    ("bug", """
def average(values):
    total = 0
    for i in range(1, len(values)):
        total += values[i]
    return total / len(values)
"""),
    ("loop", """
def long_words(words, min_len):
    kept = []
    for w in words:
        if len(w) >= min_len:
            kept.append(w)
    return kept
"""),
    ("comments", """
def celsius_to_fahrenheit(c):
    # multiply by nine fifths
    f = c * 9 / 5
    # then shift by thirty-two degrees
    return f + 32
"""),
    ("", """
def read_lines(path):
    with open(path) as f:
        lines = f.readlines()
    return [l.strip() for l in lines if l.strip()]
"""),
    ("bug comments", """
def countdown(n):
    # print n, n - 1, ..., 1 and then lift off
    for i in range(n, 1, -1):
        print(i)
    print("lift off")
"""),
    ("", """
class Counter:
    def __init__(self):
        self.n = 0
    def add(self, k=1):
        self.n += k
        return self.n
"""),
    ("loop comments", """
def upper_names(people):
    # collect the names in capital letters
    names = []
    for p in people:
        names.append(p["name"].upper())
    return names
"""),
    ("bug", """
def is_palindrome(s):
    s = s.lower()
    for i in range(len(s) // 2):
        if s[i] != s[len(s) - i]:
            return False
    return True
"""),
    ("", """
def word_freq(text):
    d = {}
    for w in text.split():
        d[w] = d.get(w, 0) + 1
    return d
"""),
    ("comments", """
def apply_discount(price, percent):
    # percent is a number like 15 for 15%
    if percent < 0 or percent > 100:
        raise ValueError("bad percent")
    # round to whole cents
    return round(price * (1 - percent / 100), 2)
"""),
    ("bug", """
def chunks(items, size):
    out = []
    for start in range(0, len(items) - size, size):
        out.append(items[start:start + size])
    return out
"""),
    ("", """
def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
"""),
    ("loop", """
def evens(limit):
    found = []
    for x in range(limit):
        if x % 2 == 0:
            found.append(x)
    return found
"""),
    ("comments", """
def max_index(xs):
    # index of the largest value
    best = 0
    for i in range(1, len(xs)):
        # keep the first one on ties
        if xs[i] > xs[best]:
            best = i
    return best
"""),
    ("loop comments", """
def file_sizes(paths):
    # size in bytes of every file
    import os
    sizes = []
    for p in paths:
        sizes.append(os.path.getsize(p))
    return sizes
"""),
    ("", """
def merge_counts(a, b):
    out = dict(a)
    for k, v in b.items():
        if k in out:
            out[k] = out[k] + v
        else:
            out[k] = v
    return out
"""),
    ("bug comments", """
def nth_line(text, n):
    # n counts from 1, so n = 1 is the first line
    lines = text.splitlines()
    return lines[n]
"""),
    ("loop", """
def initials(full_names):
    letters = []
    for name in full_names:
        letters.append(name[0])
    return letters
"""),
    ("comments", """
def parse_pair(line):
    # lines look like "key = value"
    key, _, value = line.partition("=")
    # strip spaces around both parts
    return key.strip(), value.strip()
"""),
    ("bug comments", """
def sum_to(n):
    # sum of 1 + 2 + ... + n
    total = 0
    for i in range(n):
        total += i
    return total
"""),
    ("", """
def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x
"""),
    ("loop", """
def lengths(strings):
    sizes = []
    for s in strings:
        sizes.append(len(s))
    return sizes
"""),
)

# --------------------------------------------------------------------------------------------
# building the pools
# --------------------------------------------------------------------------------------------


def _split(bank: Sequence, held_out: bool) -> list:
    """The held-out part of ``bank`` (every 5th item) if ``held_out``, else the rest."""
    return [x for i, x in enumerate(bank) if (i % _HOLD_OUT_EVERY == _HOLD_OUT_EVERY - 1)
            == held_out]


def _templated_groups(families: Sequence, modifiers: Sequence[str],
                      held_out: bool) -> list[list[str]]:
    """One group of messages per topic: every template with every modifier."""
    return [[tpl.format(t=topic) + mod for tpl in templates for mod in modifiers]
            for templates, bank in families for topic in _split(bank, held_out)]


def _passage_messages(passage: str, question: str) -> list[str]:
    """Every passage task, with the instruction both before and after the passage."""
    tasks = list(_PASSAGE_TASKS) + [t.format(q=question) for t in _QUESTION_TASKS]
    return [m for task in tasks for m in (f"{task}\n\n{passage}", f"{passage}\n\n{task}")]


def _code_messages(tags: str, code: str) -> list[str]:
    """Every code task that fits the snippet's tags, instruction before and after the code."""
    block = f"```python\n{code.strip(chr(10))}\n```"
    tasks = [task for task, need in _CODE_TASKS if not need or need in tags.split()]
    return [m for task in tasks for m in (f"{task}\n\n{block}", f"{block}\n\n{task}")]


def _groups(kind: str, held_out: bool) -> list[list[str]]:
    """Messages of one kind grouped by the bank item (topic, passage, snippet) they use."""
    if kind == "chat":
        return _templated_groups(_CHAT_FAMILIES, _CHAT_MODIFIERS, held_out)
    if kind == "free":
        return _templated_groups(_FREE_FAMILIES, _FREE_MODIFIERS, held_out)
    if kind == "grounded":
        return ([_passage_messages(p, q) for p, q in _split(_PASSAGES, held_out)]
                + [_code_messages(t, c) for t, c in _split(_SNIPPETS, held_out)])
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


@cache
def _training_pool(kind: str) -> tuple[str, ...]:
    """All distinct training messages of one kind, in a fixed order."""
    return tuple(dict.fromkeys(m for group in _groups(kind, False) for m in group))


@cache
def _benchmark_pool(kind: str) -> tuple[str, ...]:
    """All held-out messages of one kind, interleaved so that the first ones use different
    bank items: round r takes the r-th message of every (fixed-shuffled) group."""
    rng = random.Random(_BENCH_SEED + KINDS.index(kind))
    groups = _groups(kind, True)
    for group in groups:
        rng.shuffle(group)
    rng.shuffle(groups)
    rounds = max(len(g) for g in groups)
    ordered = [g[r] for r in range(rounds) for g in groups if r < len(g)]
    return tuple(dict.fromkeys(ordered))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def training_prompts(n: int = 3000, seed: int = 0) -> list[tuple[str, str]]:
    """(kind, user message) pairs, n of them, kinds in roughly equal thirds, deterministic for a
    seed, no duplicates. Built only from the training part of every bank."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    for i, kind in enumerate(KINDS):
        k = n // len(KINDS) + (i < n % len(KINDS))
        pool = _training_pool(kind)
        if k > len(pool):
            raise ValueError(f"n={n} needs {k} {kind!r} prompts but only {len(pool)} exist")
        out += [(kind, m) for m in rng.sample(pool, k)]
    rng.shuffle(out)
    return out


def benchmark_prompts(kind: str, n: int = 8) -> list[str]:
    """n held-out user messages of one kind (ValueError naming `kind` and the allowed values for
    an unknown kind; ValueError for n < 1 or n larger than available). Always the same list."""
    _check_kind(kind)
    pool = _benchmark_pool(kind)
    if not 1 <= n <= len(pool):
        raise ValueError(f"n must be between 1 and {len(pool)} for kind {kind!r}, got {n}")
    return list(pool[:n])


def num_training_prompts() -> dict[str, int]:
    """How many distinct training messages each kind can give."""
    return {kind: len(_training_pool(kind)) for kind in KINDS}
