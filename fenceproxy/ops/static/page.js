// The operator page's table script (charts.js draws its charts): once a second, ask
// the admin listener for the decisions after the last one shown and place the rows
// it renders. No framework, no build step; the server escapes every value.
"use strict";

(() => {
  const SHOWN = 200; // decisions shown, newest first
  const KEPT = 2000; // timeline rows kept, as many as the proxy keeps
  const body = document.body;
  const job = body.dataset.job || "";
  const worker = body.dataset.worker || ""; // under workers: the one this page reads
  const events = document.getElementById("events");
  const refusals = document.getElementById("refusals");
  const timeline = document.getElementById("timeline");
  const status = document.getElementById("feed-status");
  let last = Number(body.dataset.last);

  async function poll() {
    try {
      const query = new URLSearchParams({ after: String(last), job });
      if (worker) {
        query.set("worker", worker);
      }
      const answer = await fetch(`/page/feed?${query}`, { cache: "no-store" });
      if (!answer.ok) {
        throw new Error(`the admin listener answered ${answer.status}`);
      }
      const feed = await answer.json();
      events.insertAdjacentHTML("afterbegin", feed.events);
      while (events.rows.length > SHOWN) {
        events.deleteRow(-1);
      }
      refusals.innerHTML = feed.refusals;
      if (timeline && feed.timeline) {
        timeline.insertAdjacentHTML("beforeend", feed.timeline);
        while (timeline.rows.length > KEPT) {
          timeline.deleteRow(0);
        }
        timeline.closest("table").hidden = false;
        document.getElementById("timeline-empty")?.remove();
      }
      last = feed.last;
      // One clock on the page: UTC, 24-hour, as the rows' times.
      status.textContent = `live, updated ${new Date().toISOString().slice(11, 19)} UTC`;
      status.className = "live";
    } catch (error) {
      status.textContent = `not updating: ${error.message}`;
      status.className = "stale";
    }
    setTimeout(poll, 1000);
  }

  poll();
})();
