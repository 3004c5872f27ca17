"""The project-wide ground layer every package reads and writes through: data files (YAML/JSON with positions and
schemas), the data the tool ships, storage dtype tables, and atomic output. It imports nothing of ktconvert but
``errors``, so every other package may use it."""
