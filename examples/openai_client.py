"""Talk to `flashtier serve` with the official OpenAI Python client.

    flashtier serve --model DIR --port 8000 &
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python3 examples/openai_client.py

scripts/serve-check runs this file against a server on the test fixture.
"""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "none"),
)
model = client.models.list().data[0].id

# One answer, greedy.
chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Say hello."}],
    max_tokens=16,
    temperature=0,
)
print(chat.choices[0].message.content)
print(chat.usage)

# Streamed, sampled with a seed.
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Tell me a story."}],
    max_tokens=32,
    temperature=0.8,
    top_p=0.95,
    seed=7,
    stream=True,
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()
