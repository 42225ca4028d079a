"""A small set of real prompts for the real models, written for this project: summarisation,
code editing and chat over a given text, where a reply repeats what the prompt says (names,
identifiers, whole lines of code) and prompt lookup (the n-gram drafter) has something to find.
Each is one user message; the model's chat template wraps it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    name: str
    kind: str  # summarise | code-edit | chat
    message: str


_INCIDENT_REPORT = """\
Summarise the following incident report in three sentences for the engineering newsletter.

Incident report: checkout latency, 14 March

At 09:12 the on-call engineer for the payments team, Dana Okafor, was paged because the p99
latency of the checkout service had risen from 180 milliseconds to 2.4 seconds. The dashboard
showed that the increase began right after the 09:05 deployment of version 4.18 of the pricing
service. Version 4.18 added a new discount rule engine that loads every active promotion from the
database on each request instead of reading them from the in-memory cache. On a normal morning
there are about forty active promotions, but the marketing team had scheduled a spring campaign
with more than three thousand promotions that went live at 09:00. Each checkout request therefore
made one database query that returned three thousand rows, and the database connection pool of
the pricing service was exhausted within minutes. Checkout requests then waited for a free
connection, which explains the latency. At 09:31 Dana rolled the pricing service back to version
4.17, and latency returned to normal by 09:36. No payments were lost, but about 1,900 customers
saw a timeout page and 240 of them did not retry their purchase. The pricing team will restore the
cache read in version 4.19, add a load test with ten thousand promotions, and add an alert on the
connection pool usage of the pricing service."""

_MEETING_NOTES = """\
Here are the notes from our weekly planning meeting. Write a short summary and then list every
action item with its owner and due date.

Weekly planning meeting, product team

Attendees: Priya (product), Marcus (backend), Lena (frontend), Tomás (design), Aiko (support).

Priya opened the meeting with the results of the customer survey. Most customers like the new
search page, but many of them find the export button hard to find. Tomás will move the export
button to the top right corner of the results table and share a new design by Thursday.

Marcus reported that the export job times out for accounts with more than fifty thousand records.
He proposed splitting the export into pages of ten thousand records and sending the customer an
email with a download link when the export is ready. The team agreed. Marcus will write the design
document by Wednesday and start the implementation next week.

Lena said that the frontend tests have become slow: the full test suite now takes twenty-two
minutes. She will split the suite into four parallel jobs in the continuous integration pipeline by
Friday. Aiko asked whether support can get a weekly report of the most common error messages that
customers see. Priya agreed that this is useful; Aiko will draft the list of fields the report
should contain by Tuesday, and Marcus will build the report after the export work is done.

The next planning meeting is on Monday at ten."""

_CODE_RENAME = """\
Rewrite the following Python module so that the class `Inventory` is called `Stockroom`, and the
method `add_item` is called `receive`. Keep everything else exactly the same, and reply with the
whole module.

```python
from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    quantity: int
    price: float


@dataclass
class Inventory:
    items: dict[str, Item] = field(default_factory=dict)

    def add_item(self, name: str, quantity: int, price: float) -> None:
        if name in self.items:
            self.items[name].quantity += quantity
        else:
            self.items[name] = Item(name, quantity, price)

    def remove_item(self, name: str, quantity: int) -> None:
        item = self.items[name]
        if item.quantity < quantity:
            raise ValueError(f"only {item.quantity} of {name} left")
        item.quantity -= quantity

    def total_value(self) -> float:
        return sum(item.quantity * item.price for item in self.items.values())


def main() -> None:
    inventory = Inventory()
    inventory.add_item("apple", 10, 0.5)
    inventory.add_item("pear", 4, 0.75)
    inventory.remove_item("apple", 3)
    print(inventory.total_value())


if __name__ == "__main__":
    main()
```"""

_CODE_FIX = """\
The function below should return the median of a list of numbers, but it gives wrong answers for
lists with an even number of elements, and it changes the list that the caller passes in. Fix both
bugs and show the corrected function with a short explanation.

```python
def median(values):
    values.sort()
    middle = len(values) // 2
    if len(values) % 2 == 0:
        return values[middle]
    return values[middle]


def summary(values):
    return {
        "count": len(values),
        "minimum": min(values),
        "maximum": max(values),
        "median": median(values),
    }


readings = [12.5, 3.0, 7.25, 9.0, 4.5, 11.0]
print(summary(readings))
print(readings)
```"""

_CHAT_EMAIL = """\
Please rewrite this email so that it sounds polite and professional, but keep all the facts,
dates and numbers the same.

hey team, the server migration is moved AGAIN. it was supposed to be on the 3rd of June, now it
is the 17th of June because the new racks are not delivered yet. we need everyone to stop
deploying to the old cluster from the 15th of June at 18:00. the database will be read only for
about 2 hours during the migration, from 22:00 to midnight on the 17th. if your service cannot
handle a read only database tell me before the 10th of June. the old cluster will be switched
off on the 1st of July. thanks, Robert"""

_CHAT_RECIPE = """\
I have this recipe for four people but I need it for six people. Please give me the new list of
ingredients with the amounts multiplied by one and a half, and keep the steps the same.

Tomato lentil soup (serves four)

Ingredients:
- 2 tablespoons of olive oil
- 1 large onion, chopped
- 2 carrots, diced
- 3 cloves of garlic, crushed
- 200 grams of red lentils
- 800 grams of chopped tomatoes
- 1 litre of vegetable stock
- 1 teaspoon of ground cumin
- half a teaspoon of smoked paprika
- salt and pepper

Steps:
1. Heat the olive oil in a large pot and cook the onion and carrots for five minutes.
2. Add the garlic, cumin and paprika and cook for one more minute.
3. Add the lentils, tomatoes and stock, bring to the boil and simmer for twenty-five minutes.
4. Blend the soup until smooth and season with salt and pepper."""

PROMPTS = (
    Prompt("incident-summary", "summarise", _INCIDENT_REPORT),
    Prompt("meeting-actions", "summarise", _MEETING_NOTES),
    Prompt("code-rename", "code-edit", _CODE_RENAME),
    Prompt("code-fix", "code-edit", _CODE_FIX),
    Prompt("polite-email", "chat", _CHAT_EMAIL),
    Prompt("recipe-scale", "chat", _CHAT_RECIPE),
)


def take(count: int) -> list[Prompt]:
    """The first ``count`` prompts, cycling through the set when it asks for more."""
    return [PROMPTS[index % len(PROMPTS)] for index in range(count)]
