"""Run reports as HTML: figures embedded, links to other reports open their HTML pages."""

from sinkformer.runs.report import render_html


def test_links_to_markdown_reports_open_their_html_pages(tmp_path):
    (tmp_path / "vit" / "run1").mkdir(parents=True)
    (tmp_path / "vit" / "run1" / "report.html").write_text("<html></html>")
    page = render_html("[vit](vit/run1/report.md), [section](vit/run1/report.md#verdicts), "
                       "[missing](sort/run1/report.md), [web](https://example.org/report.md), [top](#top)",
                       tmp_path, "summary")
    assert '<a href="vit/run1/report.html">vit</a>' in page
    assert '<a href="vit/run1/report.html#verdicts">section</a>' in page
    assert '<a href="sort/run1/report.md">missing</a>' in page  # no HTML page there: the link is kept
    assert '<a href="https://example.org/report.md">web</a>' in page and '<a href="#top">top</a>' in page
