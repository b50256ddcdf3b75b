"""The run layout (DESIGN §7): the versioned Parquet schema a run is written in, and its files.

- ``schema``: the layout's columns, ``SampleRecord`` and ``LayoutError``;
- ``writer``: ``RunWriter``, buffered and atomic per file;
- ``reader``: a run's files, units of work and their row groups; ``decode``: a row group decoded
  zero-copy into a ``Batch`` (``batch``); ``footer``: a Parquet footer checked before pyarrow
  reads it (what pyarrow would abort the process on);
- ``inputs``: opening what a user brings (regular files, bounded reads, one-line errors).
"""
